"""pytest set-up shared by every test file.

* ``tests/`` and the repository root go on ``sys.path``, so test files write ``from _harness import run_world``
  and ``import decent_optim`` works from a plain checkout (CI also installs it with ``pip install -e .``).
* The ``multiprocess`` marker labels tests that run gloo ranks (``-m "not multiprocess"`` skips them).
* The harness's worker pools are stopped when the session ends, so pytest exits promptly.
* With pytest-timeout installed, multiprocess tests get a generous per-test backstop; without it, the
  harness's own deadlines are the backstop (no plugin is required).
"""

import sys
from pathlib import Path

import pytest

_TESTS_DIR = Path(__file__).resolve().parent
for _path in (
    _TESTS_DIR.parent,
    _TESTS_DIR,
):  # inserted at the front: the checkout wins over site-packages
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

#: Per-test limit for ``multiprocess`` tests when pytest-timeout is present: pool start-up (up to ~20 s for
#: eight ranks on two cores) plus the harness's own default task timeout of 120 s.
MULTIPROCESS_TEST_TIMEOUT_S = 300


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "multiprocess: runs ranks in worker processes through tests/_harness.py (gloo, CPU)",
    )


def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("timeout"):
        return
    for item in items:
        if item.get_closest_marker("multiprocess") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(MULTIPROCESS_TEST_TIMEOUT_S))


@pytest.fixture(scope="session", autouse=True)
def _stop_worker_pools_at_session_end():
    yield
    harness = sys.modules.get("_harness")  # not imported by a session without multiprocess tests
    if harness is not None:
        harness.shutdown_pools()

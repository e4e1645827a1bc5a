"""The golden traces (issue 62): every schedule of rounds, step for step, as recorded before the
schedule layer was rebuilt, bit for bit.

``tests/golden_traces.json`` holds, per schedule x codec x membership, every rank's per-step
line of :func:`_golden.record` (count, round, progress, a hash of the parameters, a hash of the
whole state dict). What is traced, and why each run is deterministic: ``tests/_golden.py``.
``GOLDEN_RECORD=1 python -m pytest tests/test_golden_traces.py`` writes the file anew (only
for a change of results that is meant; say so in the commit).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import _golden
import pytest
from _harness import run_world, run_world_fresh, start_alone

FILE = Path(__file__).with_name("golden_traces.json")
RECORD = os.environ.get("GOLDEN_RECORD") == "1"


def _golden_file() -> dict:
    return json.loads(FILE.read_text()) if FILE.exists() else {}


def _compare(name: str, got: object) -> None:
    # JSON turns tuples into lists: compare what the file would hold
    got = json.loads(json.dumps(got))
    if RECORD:
        data = _golden_file()
        data[name] = got
        FILE.write_text(json.dumps(data, indent=0, sort_keys=True) + "\n")
        return
    want = _golden_file().get(name)
    assert want is not None, f"no golden trace {name!r} in {FILE.name}"
    assert len(got) == len(want), (name, len(got), len(want))
    for rank, (g, w) in enumerate(zip(got, want)):
        if g is None or w is None:
            assert g == w, (name, rank)
            continue
        for key in w:
            assert key in g, (name, rank, key)
            if key != "trace":
                assert g[key] == w[key], (name, rank, key, g[key], w[key])
                continue
            assert len(g[key]) == len(w[key]), (name, rank, len(g[key]), len(w[key]))
            for line, (a, b) in enumerate(zip(g[key], w[key])):
                assert a == b, f"{name} rank {rank}, line {line}: got {a}, recorded {b}"


@pytest.mark.multiprocess
def test_every_schedule_on_fixed_members_is_the_recorded_trace():
    results = run_world(_golden.fixed, 4, timeout=240)
    for name in results[0]:
        _compare(f"fixed/{name}", [{"trace": r[name]} for r in results])


def _kill_and_join(path, schedule, codec):
    """The members' and the newcomer's results of one kill-and-join run (``_golden.member``)."""
    alone = start_alone(_golden.newcomer, path, schedule, codec)
    try:
        members = run_world_fresh(
            _golden.member, 4, path, schedule, codec, timeout=180, killed=(_golden.VICTIM,)
        )
    finally:
        joined = alone.result(timeout=180)
    # the views: the victim (id 2) lost, then the newcomer (id 4) last
    assert [m and m["view"] for m in members] == [
        (2, (0, 1, 3, 4), 0, ()),
        (2, (0, 1, 3, 4), 1, ()),
        None,
        (2, (0, 1, 3, 4), 2, ()),
    ], members
    assert joined["view"] == (2, (0, 1, 3, 4), 3, ()), joined["view"]
    return [*members, joined]


@pytest.mark.multiprocess
@pytest.mark.parametrize("codec", _golden.CODECS, ids=str)
@pytest.mark.parametrize("schedule", _golden.LIVE)
def test_a_kill_and_a_join_are_the_recorded_trace(schedule, codec, tmp_path):
    _compare(f"live/{schedule}/{codec}", _kill_and_join(str(tmp_path), schedule, codec))


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", _golden.LIVE_OUTER)
def test_outer_steps_through_a_kill_and_a_join_are_the_dense_reference(schedule, tmp_path):
    """``outer=`` with ``membership=`` (issue 62): the survivors keep their own anchors, outer
    momentum and slow weights; the newcomer receives the source's, as a resume would."""
    import torch

    results = _kill_and_join(str(tmp_path), schedule, None)
    expected = _golden.simulate(schedule)
    for got, member in zip([r for r in results if r is not None], (0, 1, 3, 4)):
        want = expected[member]
        torch.testing.assert_close(
            torch.tensor(got["final"], dtype=torch.float64), want, rtol=0, atol=1e-10
        )
    # what the newcomer received mattered: started from its own parameters instead (anchors,
    # slow weights and outer momentum), it and its neighbours end elsewhere
    alone = _golden.simulate(schedule, transfer=False)
    assert not torch.allclose(alone[4], expected[4], rtol=0, atol=1e-6)
    _compare(f"live/{schedule}/None", results)

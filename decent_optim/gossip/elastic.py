"""Refuse a torchrun set-up whose restarts would fail or hang: checked when an optimizer is
built, and when ``decent_optim`` is imported in a restarted worker.

torchrun's agent passes its workers the rendezvous store through the environment. By default
(torch 2.x) the store is shared: the agent creates one TCP store and hands the same address to
every round of workers (``TORCHELASTIC_USE_AGENT_STORE=True``, set in
``torch/distributed/elastic/agent/server/local_elastic_agent.py`` from the rendezvous handler's
``use_agent_store``). The keys the dead workers wrote there when they built their process group
stay behind, and ``init_process_group`` in the restarted workers connects to the dead workers'
addresses (``ProcessGroupGloo`` in ``_new_process_group_helper``): it fails ("Gloo
connectFullMesh failed ... Connection refused") or hangs there, past the process group's own
timeout, for minutes. Either way the restart is lost. With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's environment the
c10d rendezvous (``dynamic_rendezvous.py``: ``use_agent_store`` is False) gives every round a
new store hosted by its rank 0, and a restart resumes in seconds. The static rendezvous
(``static_tcp_rendezvous.py``) always shares its store, whatever the variable says.

The restarted workers fail or hang before they can build an optimizer, so the check must come earlier:
when the first workers build their optimizer (``TORCHELASTIC_MAX_RESTARTS`` > 0), and, for a
worker that is already a restart (``TORCHELASTIC_RESTART_COUNT`` > 0; its first attempt failed
before building one), when it imports ``decent_optim``, before its ``init_process_group``.
Outside torchrun, and under torchrun without restarts, none of these variables asks for
anything.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["check_restarted_worker", "check_restarts", "restart_hazard"]

#: the variable that gives every rendezvous round a store of its own (read by torchrun's agent)
FIX = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"


def _count(environ: Mapping[str, str], name: str) -> int:
    value = environ.get(name, "").strip()
    return int(value) if value.isdigit() else 0


def restart_hazard(environ: Mapping[str, str] | None = None) -> str | None:
    """Why torchrun's restarts of this job would fail or hang (the error message), or None."""
    env = os.environ if environ is None else environ
    restarts = _count(env, "TORCHELASTIC_MAX_RESTARTS")
    if restarts == 0 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    problem = (
        f"torchrun may restart this job's workers (TORCHELASTIC_MAX_RESTARTS={restarts}, from "
        "--max-restarts), but its rendezvous store is shared between restarts "
        "(TORCHELASTIC_USE_AGENT_STORE=True): a restarted worker finds the dead workers' "
        "addresses still in the store, and its init_process_group fails (Connection refused) or "
        "hangs for minutes instead of resuming"
    )
    if env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1":
        fix = (
            f"{FIX} is set, but this is the static rendezvous (torchrun --master-addr/"
            "--master-port without --rdzv-backend, or --rdzv-backend static), which shares its "
            "store regardless. Launch with the c10d rendezvous instead (on one node: drop "
            "--master-port, or pass --standalone; on several: --rdzv-backend c10d "
            "--rdzv-endpoint HOST:PORT) and keep the variable, or pass --max-restarts 0"
        )
    else:
        fix = (
            f"Fix: set {FIX} in the environment of the torchrun command itself, on every node "
            f"(`{FIX} torchrun --max-restarts {restarts} ...`, or `export {FIX}` in the job "
            "script before torchrun; setting it inside the training script is too late, "
            "torchrun's agent reads it), or pass --max-restarts 0"
        )
    return f"{problem}. {fix}. See docs/surviving_failures."


def check_restarts(environ: Mapping[str, str] | None = None) -> None:
    """Raise RuntimeError when torchrun's restarts of this job would fail (at optimizer start-up)."""
    message = restart_hazard(environ)
    if message is not None:
        raise RuntimeError(message)


def check_restarted_worker(environ: Mapping[str, str] | None = None) -> None:
    """:func:`check_restarts` for a worker torchrun restarted (at import, before it can hang)."""
    env = os.environ if environ is None else environ
    restart = _count(env, "TORCHELASTIC_RESTART_COUNT")
    message = restart_hazard(env) if restart > 0 else None
    if message is not None:
        raise RuntimeError(
            f"this worker is torchrun's restart number {restart} (TORCHELASTIC_RESTART_COUNT), "
            f"and its init_process_group would fail or hang: {message}"
        )

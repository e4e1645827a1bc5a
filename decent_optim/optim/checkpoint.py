"""Checkpoints: torch.optim's ``state_dict`` format plus a ``"decent_optim"`` entry.

The entry holds the round counter (``step``: completed steps, the same on every rank) and whether
a round was in flight (``pending``). A round in flight is not waited for when saving: the model
holds the rank's unmixed values, and the first step after loading runs that round again before
it mixes, which reproduces the uninterrupted run bit for bit (all ranks resume together, so
their sends match).

Without the entry -- a torch.optim checkpoint, e.g. from DDP training -- the counter is the
largest per-parameter ``step`` in the state, or 0, which every rank loading the same file agrees
on, and no round is in flight.
"""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer

from decent_optim.optim.rounds import Rounds

__all__ = ["KEY", "rounds_of", "save"]

KEY = "decent_optim"


def save(optimizer: Optimizer, rounds: Rounds) -> dict[str, Any]:
    """``optimizer``'s torch.optim state dict, with plain dicts as state, plus the entry."""
    packed = Optimizer.state_dict(optimizer)
    packed["state"] = {k: dict(v) for k, v in packed["state"].items()}
    packed[KEY] = {"step": rounds.count, "pending": rounds.in_flight}
    return packed


def rounds_of(extra: dict[str, Any] | None, state: dict[Any, dict[str, Any]]) -> tuple[int, bool]:
    """``(round counter, round in flight)`` of a loaded checkpoint (see the module docstring)."""
    if extra is not None:
        return int(extra["step"]), bool(extra.get("pending", False))
    steps = [float(s["step"]) for s in state.values() if "step" in s]
    return int(max(steps, default=0)), False

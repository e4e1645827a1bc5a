"""Checkpoints of local steps: the anchors and outer momentum, in ``state_dict()["decent_optim"]``.

With ``local_steps > 1`` a rank's state includes what :mod:`~decent_optim.optim.local_steps`
keeps per bucket besides the parameters (:meth:`Rounds.saved
<decent_optim.optim.rounds.Rounds.saved>`): the anchor (what the rank last sent, or
its outer parameters) and what its period end owns (:mod:`~decent_optim.optim.outer`): with
outer momentum the momentum buffer, with ``LocalOuterSGD`` the slow weights and their momentum. They are saved per parameter, in
torch.optim's state-dict order, under the :data:`ENTRY` key of the package's entry, so that a
resume in the middle of a period is exact. Every-step gossip saves nothing here.

With ``uneven=True`` the entry also holds where the periods stand
(:meth:`~decent_optim.optim.uneven.UnevenPeriods.state`); its rounds, not the ranks'
step counts, are what the ranks of one checkpoint must agree on (:func:`round_of`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from decent_optim.optim.local_steps import Periods
from decent_optim.optim.rounds import Rounds

__all__ = ["ENTRY", "ROUND", "check", "restore", "round_of", "save"]

#: the key of the anchors in ``state_dict()["decent_optim"]``
ENTRY = "local_steps"
#: the name of what the ranks of an uneven checkpoint must agree on (in agreement errors)
ROUND = "the round (uneven=True)"


def save(rounds: Rounds, params: list[Tensor]) -> dict[str, Any] | None:
    """The anchors and outer momentum per parameter (``params``: the optimizer's parameters in
    state-dict order), or None for every-step gossip."""
    saved = rounds.saved()
    if saved is None:
        return None
    index = {id(p): i for i, p in enumerate(params)}
    entry: dict[str, Any] = {
        "local_steps": rounds.when.local_steps,
        "outer": repr(rounds.end.setting),
    }
    if _cadence(rounds) is not None:  # another cadence than every local_steps steps
        entry["periods"] = _cadence(rounds)
    uneven = rounds.when.state(rounds)
    if uneven is not None:  # where the uneven periods stand
        entry["uneven"] = uneven
    for key, flats in saved.items():
        if flats is None:
            continue
        entry[key] = {
            index[id(p)]: view.clone()
            for bucket, flat in zip(rounds._flat.buckets, flats)
            for p, view in zip(bucket.params, bucket.views(flat))
        }
    return entry


def round_of(entry: Any, pending: bool) -> str | None:
    """Where an uneven checkpoint stands in the rounds (the same on every rank saved at one
    round, whatever its step count), or None for the other modes; raises on a bad entry."""
    state = entry.get("uneven") if isinstance(entry, dict) else None
    if state is None:
        return None
    numbers = [state.get(k) if isinstance(state, dict) else None for k in ("launched", "mixed")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in numbers):
        raise ValueError(
            f"state_dict['decent_optim'][{ENTRY!r}]['uneven'] must be what state_dict() saved "
            f"(whole numbers of rounds launched and mixed), got {state!r}"
        )
    world = state.get("world_size")  # the world that saved it: the progress is per worker
    if world is not None and (isinstance(world, bool) or not isinstance(world, int) or world < 1):
        raise ValueError(
            f"state_dict['decent_optim'][{ENTRY!r}]['uneven']['world_size'] must be the number "
            f"of workers that saved it (a whole number >= 1), got {world!r}: the progress would "
            "resume at a wrong value. Load the checkpoint as state_dict() or "
            "decent_optim.checkpoint.save wrote it"
        )
    launched, mixed = numbers
    flight = f"round {launched} in flight" if pending else "no round in flight"
    return f"local_steps={entry.get('local_steps')}, {mixed} rounds mixed, {flight}"


def check(rounds: Rounds, entry: Any) -> None:
    """Raise, before anything changes, if a checkpoint's local steps differ from the optimizer's.

    Called inside :func:`~decent_optim.optim.checkpoint.agree_to_load`, whose agreement turns
    one rank's error into the same error on every rank, naming it (alone, that rank would leave
    while the others wait for it in the agreement's collective)."""
    local, outer = rounds.when.local_steps, repr(rounds.end.setting)
    uneven = rounds.when.state(rounds) is not None
    if entry is None:
        return  # every-step gossip, or a torch.optim checkpoint: the anchors restart
    if not isinstance(entry, dict) or "local_steps" not in entry:
        raise ValueError(f"state_dict['decent_optim'][{ENTRY!r}] is not what state_dict() saved")
    saved = (entry["local_steps"], entry.get("outer"), "uneven" in entry)
    if saved != (local, outer, uneven) or entry.get("periods") != _cadence(rounds):
        raise ValueError(
            f"the checkpoint was saved with local_steps={saved[0]}, outer={saved[1]}, "
            f"uneven={saved[2]}; this optimizer has local_steps={local}, outer={outer}, "
            f"uneven={uneven}: build it with the settings of the saved run"
        )


def _cadence(rounds: Rounds) -> str | None:
    """The cadence of ``rounds`` as a checkpoint records it: None for every ``local_steps``."""
    periods = getattr(rounds.when, "periods", None)
    return None if periods is None or type(periods) is Periods else repr(periods)


def restore(rounds: Rounds, entry: dict[str, Any] | None, params: list[Tensor]) -> None:
    """Put a checkpoint's anchors and momentum back (after :meth:`Rounds.reset
    <decent_optim.optim.rounds.Rounds.reset>`)."""
    saved_keys = rounds.saved()
    if entry is None or saved_keys is None:
        return
    if rounds.when.state(rounds) is not None:
        rounds.when.load(rounds, entry["uneven"])
    index = {id(p): i for i, p in enumerate(params)}
    for key in saved_keys:
        saved = entry.get(key)
        if saved is None:
            continue
        flats = [torch.empty_like(b) for b in rounds._flat.buffers]
        for bucket, flat in zip(rounds._flat.buckets, flats):
            for p, view in zip(bucket.params, bucket.views(flat)):
                value = saved.get(index[id(p)])
                if not isinstance(value, Tensor) or value.shape != p.shape:
                    raise ValueError(
                        f"state_dict['decent_optim'][{ENTRY!r}][{key!r}] has no tensor of shape "
                        f"{tuple(p.shape)} for parameter {index[id(p)]}"
                    )
                view.copy_(value)
        rounds.load_saved(key, flats)

"""Checkpoints: torch.optim's ``state_dict`` format plus a ``"decent_optim"`` entry.

The entry holds the round counter (``step``: completed steps, the same on every rank), whether
a round was in flight (``pending``), and what the file belongs to: the ``world_size``, the
``rank`` that saved it, the ``topology`` (name, period and a hash of its weights) and a
fingerprint of the parameters saved with it (``params``: sum and norm per bucket). A round in
flight is not waited for when saving: the model holds the rank's unmixed values, and the first
step after loading runs that round again before it mixes, which reproduces the uninterrupted
run bit for bit (all ranks resume together, so their sends match).

Loading is a collective (:func:`agree_to_load`): before anything changes, each rank checks its
file on its own -- the settings of local steps (:func:`~decent_optim.optim.local_checkpoint.check`),
torch.optim's structure, every state tensor's shape, every step count, and
that the file is its own (same world size, rank or replica, and topology:
:mod:`~decent_optim.optim.ownership`) -- and then one all-gather
compares the round (counter and round in flight) across the ranks. Any problem raises the same
error on every rank, naming the ranks, instead of a late gossip error on some of them.

With ``uneven=True`` the ranks' step counts differ by design: what must agree is the rounds
(mixed, and in flight), which every rank passes in the same order; each rank resumes at its own
step count (:func:`~decent_optim.optim.local_checkpoint.round_of`). With ``compression=`` the
entry also keeps the public copies of the compressed groups (:data:`COPIES`,
:mod:`~decent_optim.gossip.compressed`), restored at the same world size; without them (another
world size, an older checkpoint) the first rounds send exact values.

Without the entry -- a torch.optim checkpoint, e.g. from DDP training -- the counter is the
largest per-parameter ``step`` in the state, or 0, which every rank loading the same file agrees
on, and no round is in flight.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor
from torch.optim import Optimizer

from decent_optim import sharded
from decent_optim.flat import FlatParams
from decent_optim.gossip.dcp_guard import ReplicaGuard
from decent_optim.optim import local_checkpoint
from decent_optim.optim.agreement import Account, agree
from decent_optim.optim.ownership import KEY, REPLICA, check_owner
from decent_optim.optim.rounds import Rounds
from decent_optim.optim.startup import Stash, fingerprint, topology_key
from decent_optim.optim.state import (
    FlatState,
    _step_count,  # the one rule for a valid step count
)
from decent_optim.rules.base import UpdateRule
from decent_optim.topologies import Topology


class Checkpointed(Protocol):
    """What this module reads of the optimizer: the engine's parts, named here instead of
    importing the engine (which imports this module)."""

    param_groups: list[dict[str, Any]]
    defaults: dict[str, Any]
    state: Any
    topology: Topology
    _rounds: Rounds
    _flat: FlatParams
    _flat_state: FlatState
    _stash: Stash | None
    _where: tuple[Any, Any]

    @property
    def rule(self) -> UpdateRule: ...

    @property
    def world_size(self) -> int: ...

    @property
    def rank(self) -> int: ...


__all__ = ["COPIES", "KEY", "Checkpointed", "Resume", "agree_to_load", "load", "save"]

#: the key of compressed gossip's public copies in the entry
COPIES = "public_copies"

_HINTS = {
    "the round": "Every rank must load a checkpoint saved at the same step: save on every rank "
    "at the same step (not only where the loss improved), and call synchronize() before saving "
    "on every rank or on none",
    local_checkpoint.ROUND: "With uneven=True the ranks take different numbers of steps, so "
    "every rank must save at the same round, each at its own step: "
    "decent_optim.checkpoint.save(root, model, opt, step=opt.round) at the first step where "
    "opt.round reached the round to save (with torch.save, the same rule), on every rank",
    "compressed gossip": "Every rank must load a checkpoint saved by the same run with the same "
    "compression=",
}


def save(optimizer: Checkpointed) -> dict[str, Any]:
    """``optimizer``'s torch.optim state dict, with plain dicts as state, plus the entry."""
    assert isinstance(optimizer, Optimizer)
    packed = Optimizer.state_dict(optimizer)
    packed["state"] = {k: dict(v) for k, v in packed["state"].items()}
    rounds = optimizer._rounds
    packed[KEY] = {
        "step": rounds.count,
        "pending": rounds.in_flight,
        "world_size": optimizer.world_size,
        "rank": optimizer.rank,
        "topology": topology_key(optimizer.topology),
        "params": [list(pair) for pair in fingerprint(optimizer._flat.buffers)],
    }
    copies = rounds.gossip.compressed_state()
    if copies is not None:
        packed[KEY][COPIES] = copies
    if any(b.mirror is not None for b in optimizer._flat.buckets):
        # torch.distributed.checkpoint keeps only "state" and "param_groups", and writes one
        # copy of what looks alike on every rank: the entries every rank shares ride along
        shared = ("step", "pending", "world_size", "topology")
        packed["param_groups"][0][KEY] = {k: packed[KEY][k] for k in shared}
        # ... and a guard that refuses a DCP save spanning several replicas (they differ)
        params = [p for b in optimizer._flat.buckets if b.mirror is not None for p in b.params]
        # (the replica's index also tells load_state_dict whose state it is: ownership.REPLICA)
        packed["param_groups"][0][KEY][REPLICA] = ReplicaGuard(
            optimizer.rank, optimizer.world_size, sharded.replica_ranks(params)
        )
    return packed


def load(
    optimizer: Checkpointed, state_dict: dict[str, Any], *, another_replica: bool = False
) -> None:
    """``optimizer.load_state_dict``: check (:func:`agree_to_load`), then load, then resume.

    ``another_replica``: accept the state another rank (replica) saved (see
    :mod:`~decent_optim.optim.ownership`).
    """
    assert isinstance(optimizer, Optimizer)
    optimizer._rounds.check_free("load_state_dict()")
    state_dict = dict(state_dict)
    extra = state_dict.pop(KEY, None)
    groups = state_dict.get("param_groups")
    if isinstance(groups, list) and groups and isinstance(groups[0], dict) and KEY in groups[0]:
        # a sharded optimizer's copy for torch.distributed.checkpoint (see save)
        state_dict["param_groups"] = [{k: v for k, v in g.items() if k != KEY} for g in groups]
        extra = extra if extra is not None else groups[0][KEY]
    resume = agree_to_load(
        optimizer, state_dict, extra, *optimizer._where, another_replica=another_replica
    )
    Optimizer.load_state_dict(optimizer, state_dict)
    for group in optimizer.param_groups:  # keys a checkpoint of an older version lacks
        for key, value in optimizer.defaults.items():
            group.setdefault(key, value)
    flat_state = optimizer._flat_state
    optimizer.state = flat_state.wrap(optimizer.state)
    optimizer._rounds.reset(resume.count, resume.pending)
    resume.restore_copies()  # after the reset, which forgets them
    flat_state.rebind(optimizer.state, optimizer.param_groups)
    stash, optimizer._stash = optimizer._stash, None
    optimizer._flat.readopt_mirrors(type(optimizer).__name__)  # sharded: weights loaded since
    if stash is not None:  # the model was loaded before the optimizer was built
        stash.restore(optimizer._flat.buffers, resume.params)
        optimizer._flat.publish()  # sharded parameters see what the buckets hold


@dataclass
class Resume:
    """What a checkpoint says about the rounds: where to continue, and the saved weights."""

    count: int
    pending: bool
    params: list[Any] | None  # the fingerprint of the parameters saved with it
    restore_copies: Callable[[], None] = lambda: None  # compressed gossip's public copies


def agree_to_load(
    optimizer: Checkpointed,
    state_dict: dict[str, Any],
    extra: Any,
    group: Any,
    device: Any,
    *,
    another_replica: bool = False,
) -> Resume:
    """Check a checkpoint on every rank and across the ranks (module docstring); raises the same
    error on every rank. ``group`` None: a world of one. ``another_replica``: a file of another
    rank or replica is meant (:func:`~decent_optim.optim.ownership.check_owner`)."""
    account, own, resume = Account(), None, Resume(0, False, None)
    entry = extra.get(local_checkpoint.ENTRY) if isinstance(extra, dict) else None
    try:
        # here, not before the call: a rank whose file's local steps do not fit must not raise
        # alone, or the others would wait for it in agree() below until the timeout
        local_checkpoint.check(optimizer._rounds, entry)
        _check_structure(optimizer, state_dict)
        resume = _read(extra, state_dict)
        check_owner(
            optimizer.world_size,
            optimizer.rank,
            optimizer.topology,
            extra,
            another_replica=another_replica,
        )
        flight = "a round in flight" if resume.pending else "no round in flight"
        rounds = local_checkpoint.round_of(entry, resume.pending)
        if rounds is None:
            account.settings = [("the round", f"{resume.count} steps done, {flight}")]
        else:  # uneven: the step counts differ by design
            account.settings = [(local_checkpoint.ROUND, rounds)]
        copies = extra.get(COPIES) if isinstance(extra, dict) and not another_replica else None
        resume.restore_copies = _copies_loader(optimizer, copies)
        codec = copies.get("codec") if isinstance(copies, dict) else None
        saved = "no public copies saved" if codec is None else f"{codec} public copies saved"
        account.settings.append(("compressed gossip", saved))
    except Exception as err:
        account.error, own = (type(err).__name__, str(err)), err
    name = type(optimizer).__name__
    timeout = getattr(optimizer._rounds.gossip, "timeout", None)
    agree(account, group, device, f"{name}.load_state_dict", own=own, hints=_HINTS, timeout=timeout)
    return resume


def _copies_loader(optimizer: Checkpointed, copies: Any) -> Callable[[], None]:
    """What restores the saved public copies of compressed gossip (checked now)."""
    if copies is None:
        return lambda: None
    try:
        return optimizer._rounds.gossip.compressed_loader(copies, optimizer._flat.buffers)
    except Exception as err:
        raise ValueError(
            f"state_dict[{KEY!r}][{COPIES!r}] (compressed gossip's public copies) does not fit "
            f"this optimizer: {err}. Build the optimizer with the settings of the saved run, "
            "or delete that entry: the copies then start over with exact values"
        ) from err


def _read(extra: Any, state_dict: dict[str, Any]) -> Resume:
    if extra is None:
        steps = [float(s["step"]) for s in state_dict["state"].values() if "step" in s]
        return Resume(int(max(steps, default=0)), False, None)
    if not isinstance(extra, dict):
        raise ValueError(
            f"state_dict[{KEY!r}] must be the dict DecentralizedOptimizer.state_dict() saved, got "
            f"{type(extra).__name__}; remove the entry to load the rest as a torch.optim checkpoint"
        )
    if "step" not in extra:
        raise ValueError(
            f"state_dict[{KEY!r}] has no 'step' (the number of completed steps), so it was not "
            "saved by DecentralizedOptimizer.state_dict(); remove the entry to load the rest as a "
            "torch.optim checkpoint"
        )
    step, pending = extra["step"], extra.get("pending", False)
    count = step.item() if isinstance(step, Tensor) and step.numel() == 1 else step
    if isinstance(count, bool) or not isinstance(count, (int, float)):
        count = -1.0
    if not (math.isfinite(count) and count >= 0 and count == int(count)):
        raise ValueError(
            f"state_dict[{KEY!r}]['step'] must count the completed steps (a whole number >= 0), "
            f"got {step!r}"
        )
    if not isinstance(pending, bool):
        raise ValueError(f"state_dict[{KEY!r}]['pending'] must be a bool, got {pending!r}")
    params = extra.get("params")
    return Resume(int(count), pending, params if isinstance(params, list) else None)


def _check_structure(optimizer: Checkpointed, state_dict: dict[str, Any]) -> None:
    """torch.optim's checks of the groups, and every state tensor's shape and step count."""
    if not isinstance(state_dict.get("state"), dict) or "param_groups" not in state_dict:
        raise ValueError(
            "an optimizer state dict must have 'state' (a dict) and 'param_groups', as "
            "torch.optim's state_dict() returns; got the keys "
            f"{sorted(map(str, state_dict))}"
        )
    saved_groups, groups = state_dict["param_groups"], optimizer.param_groups
    if len(saved_groups) != len(groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    rule = optimizer.rule
    for saved, group in zip(saved_groups, groups):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                "loaded state dict contains a parameter group that doesn't match the size of "
                "optimizer's group"
            )
        names = group.get("param_names") or [None] * len(group["params"])
        keys = rule.keys({**group, **saved})
        for index, p, name in zip(saved["params"], group["params"], names):
            entry = state_dict["state"].get(index, {})
            who = f"{name!r}" if name else f"of shape {tuple(p.shape)}"
            for key in keys:
                value = entry.get(key)
                if value is not None and (not isinstance(value, Tensor) or value.shape != p.shape):
                    got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                    raise ValueError(
                        f"optimizer state {key!r} of the parameter {who} must be a tensor of "
                        f"shape {tuple(p.shape)}, got {got}"
                    )
            if rule.counts_steps and "step" in entry:
                _step_count(entry["step"], p)

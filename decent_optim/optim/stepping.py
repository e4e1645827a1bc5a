"""The eager parts of a step, around the update rule: :func:`prepare` before it, :func:`conclude` after.

Under ``torch.compile`` only the update rule is traced; these run eagerly (the engine keeps
them out of the graph). Traced, the in-place mix of a bucket and the rule's writes through the
parameters would look like unrelated tensors to the compiler: each parameter's ``.data`` aliases
its bucket with a storage of its own (:mod:`decent_optim.flat`), so the graph read the
parameters before the mix was written.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor

from decent_optim.flat import FlatParams
from decent_optim.gossip.handle import NO_MIX, PendingMix
from decent_optim.optim.inputs import AveragedCheck, check_membership, gradients
from decent_optim.optim.param_owner import ParamOwner
from decent_optim.optim.rounds import Rounds
from decent_optim.optim.startup import Stash
from decent_optim.optim.state import FlatState
from decent_optim.rules.base import Amp, Batch

__all__ = ["Stepped", "Work", "conclude", "prepare"]

#: one bucket's update in a step: its index, batch, param group, mix left to apply, GradScaler values
Work = tuple[int, Batch, dict[str, Any], PendingMix, Amp]


class Stepped(Protocol):
    """What a step reads and writes of the optimizer: the engine's parts, named here instead of
    importing the engine (which imports this module)."""

    param_groups: list[dict[str, Any]]
    state: Any
    _member: ParamOwner
    _group_params: list[list[Tensor]]
    _rounds: Rounds
    _flat: FlatParams
    _frozen: list[Tensor]
    _stash: Stash | None
    _averaged: AveragedCheck
    _flat_state: FlatState

    def _readopt(self) -> None: ...


def prepare(opt: Stepped, traced: bool) -> list[Work]:
    """Checks, the round's wait and mix, and the batches the rule updates.

    ``traced``: the step is being compiled; every mix is then applied here, eagerly, and the
    rule gets per-parameter batches with nothing left to mix.
    """
    name = type(opt).__name__
    check_membership(opt._member, opt.param_groups, opt._group_params)
    opt._readopt()
    first = not opt._rounds.count and not opt.state
    grads = gradients(opt._flat, opt._frozen, name, first=first)
    opt._stash = None  # training has begun from the broadcast values
    if not opt._averaged.done:  # were the gradients all-reduced (DDP) already?
        opt._averaged.step(grads, opt._rounds.gossip, opt._flat, name)
    if opt._flat_state.stale:
        opt._flat_state.rebind(opt.state, opt.param_groups)
    mixes = opt._rounds.take()
    # set by GradScaler.step
    amp = Amp(getattr(opt, "grad_scale", None), getattr(opt, "found_inf", None))
    work = []
    for index, bucket in enumerate(opt._flat.buckets):
        group = opt.param_groups[bucket.group_index]
        batch, mix = opt._flat_state.batch(
            index,
            opt.state,
            group,
            grads[index],
            NO_MIX if mixes is None else mixes[index],
            opt._rounds.gossip.idle_buffer,
            traced=traced,
        )
        if batch is not None:
            work.append((index, batch, group, mix, amp))
    return work


def conclude(opt: Stepped, work: list[Work]) -> None:
    """Count the updates, launch the next round, and publish sharded values."""
    for index, batch, _, _, amp in work:
        opt._flat_state.updated(index, batch, amp.active)
    # launch even when no parameter had a gradient: the neighbours wait on this round
    opt._rounds.launch()
    # sharded parameters: what FSDP2 all-gathers next (after local steps' outer step)
    opt._flat.publish()

"""What a step reads from the model: each bucket's gradients, after the checks that need them."""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from decent_optim.flat import FlatParams
from decent_optim.gossip import Gossiper, LocalGossiper
from decent_optim.optim.param_owner import ParamOwner

__all__ = ["ALREADY_AVERAGED", "AveragedCheck", "check_membership", "gradients"]


def check_membership(
    member: ParamOwner, groups: list[dict[str, Any]], built: list[list[Tensor]]
) -> None:
    """Raise unless the optimizer still owns its parameters and ``param_groups`` holds exactly
    the parameters it was built with (``built``, per group)."""
    if member.lost is not None:
        raise RuntimeError(f"this {member.name} cannot step any more: {member.lost}")
    changed = [
        k
        for k, (group, params) in enumerate(zip(groups, built))
        if len(group["params"]) != len(params)
        or not all(map(operator.is_, group["params"], params))
    ]
    if not changed and len(groups) == len(built):
        return
    k = changed[0] if changed else min(len(groups), len(built))
    raise RuntimeError(
        f"the parameters of {member.name}.param_groups[{k}] changed after it was built (one "
        "appended, removed or replaced by hand, or a group added or removed): a new one would "
        "never be updated nor gossiped, because the parameters live in flat buffers shared with "
        "the peers. Pass every parameter to the constructor (a group with lr=0 can wait for its "
        "turn)"
    )


#: the warning for gradients that were averaged before step() (a DDP wrapper, a comm hook)
ALREADY_AVERAGED = (
    "{name}: the gradients are identical on every rank, so something averaged them before "
    "step(): the model is wrapped in DistributedDataParallel, or a hook all-reduces its "
    "gradients. {name} averages the parameters itself, so the job pays for both and the gossip "
    "mixes identical copies. Fix: drop the wrapper (`model = DDP(model)` -> `model`; with "
    "Lightning use decent_optim.integrations.lightning.DecentralizedStrategy, with Hugging Face "
    "DecentralizedTrainer or DecentralizedAccelerator from decent_optim.integrations). If "
    "instead every rank reads the same batches, give each its own (DistributedSampler). See "
    "docs/migrating_from_ddp."
)


def gradients(
    flat: FlatParams, frozen: list[Tensor], name: str, *, first: bool
) -> list[list[Tensor | None]]:
    """Each bucket's gradients (None where a parameter has none); raises on what cannot be stepped.

    Args:
        flat: the buckets.
        frozen: the parameters left out of the buckets (``requires_grad=False`` at construction).
        name: the optimizer's class name, for messages.
        first: no step was taken and no state exists yet (a step without any gradient is then
            a missing ``backward()``, not a step where nothing was used).
    """
    grads = [b.grads() for b in flat.buckets]
    present = [g for bucket in grads for g in bucket if g is not None]
    if any(g.is_sparse for g in present):
        raise RuntimeError(
            f"{name} does not support sparse gradients; use dense gradients "
            "(e.g. nn.Embedding(sparse=False))"
        )
    for p in frozen:
        if p.grad is not None:
            raise RuntimeError(
                f"a parameter of shape {tuple(p.shape)} had requires_grad=False when {name} was "
                "built, so it is not gossiped, but it now has a gradient; unfreeze parameters "
                "before building the optimizer"
            )
    if not present and first:
        raise RuntimeError(
            "step() was called before any backward(): no parameter has a gradient. Call "
            "loss.backward() first (every rank must then call step() once per iteration)"
        )
    return grads


class AveragedCheck:
    """Whether the gradients are bit-identical on every rank: asked at the first step, answered
    (with a warning when they are) at the second.

    Each rank computes its gradient on its own batches, so identical gradients mean they were
    all-reduced before ``step()`` (or every rank read the same data). The question is one
    all-reduce in the background: waiting for it inside the step would deadlock optimizers that
    the ranks step in different orders.
    """

    def __init__(self) -> None:
        self.done = False
        self._answer: Callable[[], bool] | None = None

    def step(
        self,
        grads: list[list[Tensor | None]],
        gossip: Gossiper | LocalGossiper,
        flat: FlatParams,
        name: str,
    ) -> None:
        if self._answer is not None:
            if self._answer():
                warnings.warn(ALREADY_AVERAGED.format(name=name), stacklevel=3)
            self.done, self._answer = True, None
            return
        if gossip.world_size == 1:  # no other rank to compare with
            self.done = True
            return
        device = flat.buckets[0].device if flat.buckets else torch.device("cpu")
        total = torch.zeros(2, dtype=torch.float64, device=device)
        for g in (g for bucket in grads for g in bucket if g is not None):
            total[0] += g.sum(dtype=torch.float64).to(device)
            total[1] += torch.linalg.vector_norm(g, dtype=torch.float64).to(device)
        self._answer = gossip.identical(
            total, "the check for gradients averaged before step() (asked at step 1)"
        )

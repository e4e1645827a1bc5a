"""What a step reads from the model: each bucket's gradients, after the checks that need them."""

from __future__ import annotations

import operator
from typing import Any

from torch import Tensor

from decent_optim.flat import FlatParams
from decent_optim.optim.membership import Membership

__all__ = ["check_membership", "gradients"]


def check_membership(
    member: Membership, groups: list[dict[str, Any]], built: list[list[Tensor]]
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
    grads = [[p.grad for p in b.params] for b in flat.buckets]
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

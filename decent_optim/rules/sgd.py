"""SGD (momentum, dampening, Nesterov, L2 decay) as an update rule: torch's fused SGD kernel.

Math: see :class:`decent_optim.DSGD`. Inside ``torch.compile`` (``torch.compile(opt.step)``) the
fused kernel cannot be traced (it has no fake-tensor kernel), so :func:`sgd_math_` spells the
same arithmetic out in elementwise operations, as torch.optim.SGD's foreach path does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from decent_optim.flat import Bucket
from decent_optim.gossip.handle import PendingMix
from decent_optim.rules.base import Amp, Batch, UpdateRule, finish_mix

__all__ = ["SgdRule", "sgd_math_"]


class SgdRule(UpdateRule):
    """torch.optim.SGD's step; a momentum buffer starts at the first gradient, as in torch."""

    counts_steps = False
    flags = ("maximize", "foreach", "differentiable", "fused")

    def keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["momentum"] else ()

    def flatten(self, bucket: Bucket, group: dict[str, Any]) -> bool:
        # torch's fused SGD costs only a few microseconds per tensor on CPUs, about what copying
        # the gradients into a flat buffer costs (measured: 600 tensors, 2.5M parameters, 2
        # cores: 3.5 ms on the lists, 4.3 ms flat), so the kernel always runs on the lists
        return False

    def update(self, batch: Batch, group: dict[str, Any], *, mix: PendingMix, amp: Amp) -> None:
        momentum = group["momentum"]
        # without momentum, p - lr (g + w p) = (1 - lr w) p - lr g: the factor joins the decay;
        # with momentum, w p would enter the buffer
        foldable = not momentum and amp.found_inf is None
        decay, _ = finish_mix(
            batch, mix, lr=group["lr"], weight_decay=group["weight_decay"], foldable=foldable
        )
        parts = [batch]
        if momentum and any(batch.fresh) and not all(batch.fresh):
            # torch starts a momentum buffer at the gradient itself: run the new ones separately
            parts = [batch.split(batch.fresh), batch.split([not f for f in batch.fresh])]
        for part in parts:
            if torch.compiler.is_compiling():
                if amp.active:
                    raise NotImplementedError(
                        "GradScaler with a compiled optimizer step is not supported"
                    )
                first = bool(part.fresh) and part.fresh[0]
                for k, p in enumerate(part.params):
                    buf = part.state["momentum_buffer"][k] if momentum else None
                    sgd_math_(p, part.grads[k], buf, group, weight_decay=decay, first=first)
                continue
            torch._fused_sgd_(
                part.params,
                part.grads,
                part.state["momentum_buffer"] if momentum else [],
                weight_decay=decay,
                momentum=momentum,
                lr=group["lr"],
                dampening=group["dampening"],
                nesterov=group["nesterov"],
                maximize=group["maximize"],
                is_first_step=bool(part.fresh) and part.fresh[0],
                grad_scale=amp.grad_scale,
                found_inf=amp.found_inf,
            )


def sgd_math_(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor | None,
    group: dict[str, Any],
    *,
    weight_decay: float,
    first: bool,
) -> None:
    """One SGD step of one tensor in elementwise operations, with ``group``'s other
    hyper-parameters; ``first``: the momentum buffer starts at this gradient, as in torch."""
    g = -grad if group["maximize"] else grad
    if weight_decay:
        g = g + weight_decay * param
    momentum = group["momentum"]
    if momentum_buffer is not None and momentum:
        if first:
            momentum_buffer.copy_(g)
        else:
            momentum_buffer.mul_(momentum).add_(g, alpha=1 - group["dampening"])
        g = g + momentum * momentum_buffer if group["nesterov"] else momentum_buffer
    param.add_(g, alpha=-group["lr"])

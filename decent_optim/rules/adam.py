"""Adam and AdamW as an update rule: torch's fused kernel on the mixed parameters.

Math: see :class:`decent_optim.DecentralizedAdam`. The eager step is the kernel behind
``torch.optim.Adam(fused=True)``; inside ``torch.compile`` (e.g. ``torch.compile(opt.step)``),
where that kernel cannot be traced on parameter views, :func:`adam_math_` spells the same
arithmetic out in elementwise operations.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from decent_optim.gossip.handle import PendingMix
from decent_optim.rules.base import Amp, Batch, UpdateRule, finish_mix

__all__ = ["AdamRule", "adam_math_", "fused_adam_"]


class AdamRule(UpdateRule):
    """Adam (L2 weight decay) or AdamW (``decoupled_weight_decay``), per param group."""

    def keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        moments = ("exp_avg", "exp_avg_sq")
        return (*moments, "max_exp_avg_sq") if group["amsgrad"] else moments

    def update(self, batch: Batch, group: dict[str, Any], *, mix: PendingMix, amp: Amp) -> None:
        decoupled = group["decoupled_weight_decay"]
        lr, weight_decay = group["lr"], group["weight_decay"]
        # Adam without weight decay is AdamW without it, so the factor folds there too; a step
        # GradScaler may skip must not carry the factor (it would be skipped with it)
        foldable = (decoupled or not weight_decay) and amp.found_inf is None
        decay, folded = finish_mix(batch, mix, lr=lr, weight_decay=weight_decay, foldable=foldable)
        vmax = batch.state["max_exp_avg_sq"] if group["amsgrad"] else []
        batch.advance_steps()
        if torch.compiler.is_compiling():
            if amp.active:
                raise NotImplementedError(
                    "GradScaler with a compiled optimizer step is not supported"
                )
            for k, p in enumerate(batch.params):
                m, v = batch.state["exp_avg"][k], batch.state["exp_avg_sq"][k]
                most = vmax[k] if vmax else None
                adam_math_(
                    p,
                    batch.grads[k],
                    m,
                    v,
                    most,
                    batch.steps[k],
                    group,
                    weight_decay=decay,
                    decoupled=decoupled or folded,
                )
            return
        fused_adam_(
            batch.params,
            batch.grads,
            batch.state["exp_avg"],
            batch.state["exp_avg_sq"],
            vmax,
            batch.steps,
            group,
            weight_decay=decay,
            decoupled=decoupled or folded,
            amp=amp,
        )
        batch.uncount_skipped(amp.found_inf)


def fused_adam_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    group: dict[str, Any],
    *,
    weight_decay: float,
    decoupled: bool,
    amp: Amp,
) -> None:
    """torch's fused Adam (or AdamW, ``decoupled``) kernel with ``group``'s hyper-parameters.

    ``steps`` must already count this step. Math: see :class:`decent_optim.DecentralizedAdam`.
    """
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    beta1, beta2 = group["betas"]
    kernel(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        steps,
        lr=group["lr"],
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        eps=group["eps"],
        amsgrad=group["amsgrad"],
        maximize=group["maximize"],
        grad_scale=amp.grad_scale,
        found_inf=amp.found_inf,
    )


def adam_math_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    max_exp_avg_sq: Tensor | None,
    step: Tensor,
    group: dict[str, Any],
    *,
    weight_decay: float,
    decoupled: bool,
) -> None:
    """One Adam/AdamW step of one tensor in elementwise operations, with ``group``'s other
    hyper-parameters; ``step`` already counts it. Math: see :class:`decent_optim.DecentralizedAdam`.
    """
    lr, (beta1, beta2) = group["lr"], group["betas"]
    g = -grad if group["maximize"] else grad
    if decoupled:
        param.mul_(1 - lr * weight_decay)
    else:
        g = g + weight_decay * param
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    second = exp_avg_sq
    if max_exp_avg_sq is not None:
        max_exp_avg_sq.copy_(torch.maximum(max_exp_avg_sq, exp_avg_sq))
        second = max_exp_avg_sq
    # the counters are float32; the bias corrections in float64, as torch's kernels compute them
    count = step.double()
    bias1 = 1 - beta1**count
    bias2_sqrt = (1 - beta2**count).sqrt()
    param.sub_(lr * (exp_avg / bias1) / (second.sqrt() / bias2_sqrt + group["eps"]))

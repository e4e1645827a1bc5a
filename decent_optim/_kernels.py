"""Pure update math on lists of tensors: no state, no communication, no defaults.

Each kernel mutates its inputs in place and returns None. The lists are per-parameter views of
one bucket, so every list shares one device and one dtype, as torch's fused kernels require.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


@torch.no_grad()
def adam_update_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    decoupled: bool,
) -> None:
    """One Adam (``decoupled=False``) or AdamW step; ``steps`` are incremented first.

    Math: see :class:`decent_optim.DecentralizedAdam`. Runs torch's fused multi-tensor kernel,
    the one ``torch.optim.Adam(fused=True)`` uses.
    """
    torch._foreach_add_(steps, 1)
    fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
    fused(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
        lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
        amsgrad=amsgrad, maximize=maximize,
    )  # fmt: skip


@torch.no_grad()
def sgd_update_(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    *,
    lr: float | Tensor,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    first_step: bool,
) -> None:
    """One SGD step; ``first_step`` starts the momentum buffers at the gradient, as torch does.

    Math: see :class:`decent_optim.DSGD`. Runs torch's fused SGD kernel.
    """
    torch._fused_sgd_(
        params, grads, momentum_buffers if momentum else [],
        weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=dampening,
        nesterov=nesterov, maximize=maximize, is_first_step=first_step,
    )  # fmt: skip


@torch.no_grad()
def accum_adam_update_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    grad_accs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    *,
    step: int,
    accum_iter: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    decoupled: bool,
) -> None:
    """One AccumAdam step; ``step`` counts from 1 and includes this one.

    ``exp_avgs``/``exp_avg_sqs`` hold the moment bases, refreshed only every ``accum_iter`` steps
    from the mean gradient ``grad_accs`` collects. Math: see :class:`decent_optim.AccumAdam`.
    """
    if maximize:
        grads = list(torch._foreach_neg(grads))
    if decoupled:
        if weight_decay:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
    elif weight_decay:
        grads = list(torch._foreach_add(grads, params, alpha=weight_decay))
    k = math.ceil(step / accum_iter)  # moment bases refreshed so far, counting this step's
    bias1 = 1 - beta1**k
    bias2_sqrt = math.sqrt(1 - beta2**k)
    m = torch._foreach_mul(exp_avgs, beta1)
    torch._foreach_add_(m, grads, alpha=1 - beta1)
    v: list[Tensor] | tuple[Tensor, ...] = torch._foreach_mul(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
    if amsgrad:
        torch._foreach_maximum_(max_exp_avg_sqs, v)
        v = max_exp_avg_sqs
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, bias2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, m, denom, value=-lr / bias1)
    torch._foreach_add_(grad_accs, grads, alpha=1 / accum_iter)
    if step % accum_iter == 0:
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grad_accs, alpha=1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grad_accs, grad_accs, value=1 - beta2)
        torch._foreach_zero_(grad_accs)

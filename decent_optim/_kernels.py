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
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """One Adam (``decoupled=False``) or AdamW step; ``steps`` are incremented first.

    ``grad_scale``/``found_inf`` come from a ``GradScaler``: gradients are divided by the
    scale, and nothing changes (the step counters included) when ``found_inf`` is nonzero.
    Math: see :class:`decent_optim.DecentralizedAdam`. Runs torch's fused multi-tensor kernel,
    the one ``torch.optim.Adam(fused=True)`` uses.
    """
    torch._foreach_add_(steps, 1)
    if torch.compiler.is_compiling():
        # inside torch.compile (e.g. ``torch.compile(opt.step)``) the fused op cannot be
        # functionalized on parameter views; spell the same math out in foreach ops
        _adam_foreach_(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr=lr, beta1=beta1,
            beta2=beta2, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
            decoupled=decoupled, grad_scale=grad_scale, found_inf=found_inf,
        )  # fmt: skip
        return
    _fused_adam(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr=lr, beta1=beta1,
        beta2=beta2, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
        decoupled=decoupled, grad_scale=grad_scale, found_inf=found_inf,
    )  # fmt: skip
    if found_inf is not None:
        torch._foreach_sub_(steps, [found_inf] * len(steps))  # a skipped step does not count


def _decay_(
    params: list[Tensor],
    grads: list[Tensor],
    *,
    lr: float | Tensor,
    weight_decay: float,
    maximize: bool,
    decoupled: bool,
) -> list[Tensor]:
    """Negate for ``maximize``, then apply weight decay as torch's Adam/AdamW do.

    Decoupled decay shrinks ``params`` in place; L2 decay returns new gradients
    ``g + weight_decay * p``. The caller's gradient tensors are never modified.
    """
    if maximize:
        grads = list(torch._foreach_neg(grads))
    if decoupled:
        if weight_decay:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
    elif weight_decay:
        grads = list(torch._foreach_add(grads, params, alpha=weight_decay))
    return grads


def _adam_foreach_(
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
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
) -> None:
    """The fused Adam kernel's math in foreach ops (``steps`` already incremented).

    Math: see :class:`decent_optim.DecentralizedAdam`.
    """
    if found_inf is not None or grad_scale is not None:
        raise NotImplementedError("GradScaler with a compiled step is not supported")
    grads = _decay_(
        params, grads, lr=lr, weight_decay=weight_decay, maximize=maximize, decoupled=decoupled
    )
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    bias1 = [1 - beta1**s for s in steps]
    bias2_sqrt = [(1 - beta2**s).sqrt() for s in steps]
    second = max_exp_avg_sqs if amsgrad else exp_avg_sqs
    if amsgrad:
        torch._foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs)
    denom = torch._foreach_sqrt(second)
    torch._foreach_div_(denom, bias2_sqrt)
    torch._foreach_add_(denom, eps)
    step_size = [-lr / b for b in bias1]
    torch._foreach_mul_(
        denom, [1 / s for s in step_size]
    )  # so that addcdiv adds -lr/bias1 * m/denom
    torch._foreach_addcdiv_(params, exp_avgs, denom)


@torch.no_grad()
def adam_update_uniform_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    step_counts: Tensor,
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
    """:func:`adam_update_` for tensors that are all at the same step.

    ``step_counts`` holds every parameter's step counter (equal values); it is incremented with
    one operation, and its first entry serves as the step of every tensor in the lists (which
    may be a single flat buffer covering all the parameters). Math: see
    :class:`decent_optim.DecentralizedAdam`.
    """
    step_counts.add_(1)
    _fused_adam(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, [step_counts[0]] * len(params),
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
        maximize=maximize, decoupled=decoupled,
    )  # fmt: skip


def _fused_adam(
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
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """torch's fused Adam (``decoupled=False``) or AdamW kernel; steps already incremented."""
    fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
    fused(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
        lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
        amsgrad=amsgrad, maximize=maximize, grad_scale=grad_scale, found_inf=found_inf,
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
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """One SGD step; ``first_step`` starts the momentum buffers at the gradient, as torch does.

    Math: see :class:`decent_optim.DSGD`. Runs torch's fused SGD kernel.
    """
    torch._fused_sgd_(
        params, grads, momentum_buffers if momentum else [],
        weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=dampening,
        nesterov=nesterov, maximize=maximize, is_first_step=first_step,
        grad_scale=grad_scale, found_inf=found_inf,
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
    grads = _decay_(
        params, grads, lr=lr, weight_decay=weight_decay, maximize=maximize, decoupled=decoupled
    )
    k = math.ceil(step / accum_iter)  # moment bases refreshed so far, counting this step's
    bias1 = 1 - beta1**k
    bias2_sqrt = math.sqrt(1 - beta2**k)
    m = torch._foreach_mul(exp_avgs, beta1)
    torch._foreach_add_(m, grads, alpha=1 - beta1)
    v: list[Tensor] = list(torch._foreach_mul(exp_avg_sqs, beta2))
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
        accum_adam_refresh_(exp_avgs, exp_avg_sqs, grad_accs, beta1=beta1, beta2=beta2)


@torch.no_grad()
def accum_adam_step_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    grad_acc: Tensor,
    max_exp_avg_sq: Tensor | None,
    scratch: tuple[Tensor, Tensor],
    step: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
    decoupled: bool,
    accum_iter: int,
) -> None:
    """AccumAdam's parameter step on flat tensors, leaving the moment bases as they are.

    ``step`` holds the bias-correction count ``k = ceil(t / accum_iter)``. The moments of this
    step are formed in ``scratch`` (two tensors like ``param``: copies of the bases), where
    torch's fused Adam kernel updates them together with the parameter in one pass. The
    gradient, as the update sees it (negated for ``maximize``, plus ``weight_decay * param`` for
    L2 decay), joins ``grad_acc``. The refresh at the end of a window is
    :func:`accum_adam_refresh_`. Math: see :class:`decent_optim.AccumAdam`.
    """
    grad_acc.add_(grad, alpha=(-1.0 if maximize else 1.0) / accum_iter)
    if weight_decay and not decoupled:
        grad_acc.add_(param, alpha=weight_decay / accum_iter)  # before the update changes param
    m, v = scratch
    m.copy_(exp_avg)
    v.copy_(exp_avg_sq)
    _fused_adam(
        [param], [grad], [m], [v], [] if max_exp_avg_sq is None else [max_exp_avg_sq], [step],
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
        amsgrad=max_exp_avg_sq is not None, maximize=maximize, decoupled=decoupled,
    )  # fmt: skip


@torch.no_grad()
def accum_adam_refresh_(
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    grad_accs: list[Tensor],
    *,
    beta1: float,
    beta2: float,
) -> None:
    """End of an AccumAdam window: the bases take one moment step with the mean gradient
    ``grad_accs``, which then restarts from zero. Math: see :class:`decent_optim.AccumAdam`."""
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, grad_accs, alpha=1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grad_accs, grad_accs, value=1 - beta2)
    torch._foreach_zero_(grad_accs)


def folded_decay(factor: float, lr: float, weight_decay: float) -> float:
    """The decay ``w`` with ``1 - lr * w == factor * (1 - lr * weight_decay)``; ``lr > 0``.

    A kernel whose first operation on the parameter is ``p <- (1 - lr * w) * p`` (AdamW's
    decoupled decay; SGD's L2 decay when there is no momentum, since then
    ``p - lr * (g + w * p) == (1 - lr * w) * p - lr * g``), called with this ``w`` on
    ``p / factor``, computes what it would with ``weight_decay`` on ``p``: the pending factor
    of a mix (:meth:`decent_optim.gossip.GossipHandle.mix_unscaled_`) is applied in the same
    pass as the update. The result differs from multiplying first by a few units in the last
    place.
    """
    return (1.0 - factor * (1.0 - lr * weight_decay)) / lr

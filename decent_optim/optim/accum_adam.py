"""AccumAdam and AccumAdamW: Adam whose moment estimates are refreshed every few steps."""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from decent_optim._kernels import accum_adam_update_
from decent_optim._validation import (
    check_accum_iter,
    check_betas,
    check_eps,
    check_lr,
    check_unsupported,
    check_weight_decay,
)
from decent_optim.optim._base import DecentralizedOptimizer, _BucketState
from decent_optim.topologies import Topology

__all__ = ["AccumAdam", "AccumAdamW"]


class AccumAdam(DecentralizedOptimizer):
    r"""Decentralized Adam for small local batches: moment bases refreshed every ``accum_iter`` steps.

    .. math::
        m_t = \beta_1 \bar m + (1-\beta_1) g_t, \quad v_t = \beta_2 \bar v + (1-\beta_2) g_t^2,
        \quad x_i \leftarrow \tilde x_i - \eta \frac{m_t / (1-\beta_1^k)}{\sqrt{v_t/(1-\beta_2^k)} + \epsilon}

    where :math:`\tilde x_i = \sum_j W^{(t)}_{ij} x_j` is the mixed parameter and
    :math:`k = \lceil t / s \rceil`, :math:`s` = ``accum_iter``. A parameter step is taken every
    iteration, but the bases :math:`\bar m, \bar v` move only every :math:`s` steps, by the mean
    gradient of those steps: the moments see an effective batch :math:`s` times larger, which
    keeps them from getting noisy when many workers share a fixed global batch. Weight decay is L2
    (``weight_decay * x`` joins the gradient). With ``accum_iter=1`` this is Adam, and with one
    worker and ``accum_iter=1`` exactly :class:`torch.optim.Adam`.

    The state keys ``exp_avg`` and ``exp_avg_sq`` hold :math:`\bar m` and :math:`\bar v`;
    ``grad_acc`` holds the running mean gradient of the current window.

    Args:
        params: parameters or param groups, as for :class:`torch.optim.Adam`.
        lr, betas, eps, weight_decay, amsgrad, maximize: as for :class:`torch.optim.Adam`.
        accum_iter: steps per refresh of the moment bases (the paper's :math:`s`).
        foreach, fused: accepted for compatibility; the update runs torch's foreach kernels.
        topology, process_group, bucket_cap_mb, local_world_size, timeout, global_avg_every: as for
            :class:`DecentralizedAdam`.

    Example:
        >>> opt = AccumAdam(model.parameters(), lr=1e-3, accum_iter=4, topology="ring")  # doctest: +SKIP

    References:
        Wang, Zhang, Wu, Johansson, "From Promise to Practice: Realizing High-performance
        Decentralized Training", ICLR 2025.
    """

    _decoupled = False

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        *,
        accum_iter: int = 4,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        topology: str | Topology = "ring",
        process_group: Any = None,
        bucket_cap_mb: float = 25,
        local_world_size: int | None = None,
        timeout: float | datetime.timedelta | None = None,
        global_avg_every: int | None = None,
    ) -> None:
        check_lr(lr)
        check_eps(eps)
        check_betas(betas)
        check_weight_decay(weight_decay)
        check_accum_iter(accum_iter)
        check_unsupported(type(self).__name__, capturable=capturable, differentiable=differentiable)
        defaults = dict(
            lr=lr, betas=tuple(float(b) for b in betas), eps=eps, weight_decay=weight_decay,
            amsgrad=amsgrad, maximize=maximize, accum_iter=accum_iter, foreach=foreach,
            capturable=False, differentiable=False, fused=fused,
        )  # fmt: skip
        super().__init__(
            params, defaults, topology=topology, process_group=process_group,
            bucket_cap_mb=bucket_cap_mb, local_world_size=local_world_size, timeout=timeout,
            global_avg_every=global_avg_every,
        )  # fmt: skip

    def _flat_state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        extra = ("max_exp_avg_sq",) if group["amsgrad"] else ()
        return ("exp_avg", "exp_avg_sq", "grad_acc", *extra)

    def _init_state(self, group: dict[str, Any], state: dict[str, Any], p: Tensor) -> None:
        state["step"] = torch.zeros((), dtype=torch.float32)

    def _after_load(self, state: dict[str, Any], p: Tensor) -> None:
        if isinstance(state.get("step"), Tensor):  # a copy: the kernel counts in place
            state["step"] = state["step"].to(dtype=torch.float32, device="cpu", copy=True)

    def _update(
        self,
        group: dict[str, Any],
        state: _BucketState,
        *,
        grad_scale: Tensor | None,
        found_inf: Tensor | None,
    ) -> None:
        beta1, beta2 = group["betas"]
        if found_inf is not None and float(found_inf):
            return  # GradScaler found inf/NaN: skip the update (the gossip still runs)
        if grad_scale is not None:
            state.grads = list(torch._foreach_div(state.grads, grad_scale))
        steps = [int(st["step"]) + 1 for st in state.states]
        for st in state.states:
            st["step"] += 1
        # parameters that skipped steps (no gradient) are at another step count: one call each
        for step in sorted(set(steps)):
            part = state.split([s == step for s in steps])
            accum_adam_update_(
                part.params, part.grads, part.get("exp_avg"), part.get("exp_avg_sq"),
                part.get("grad_acc"), part.get("max_exp_avg_sq") if group["amsgrad"] else [],
                step=step, accum_iter=group["accum_iter"], lr=float(group["lr"]), beta1=beta1,
                beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                amsgrad=group["amsgrad"], maximize=group["maximize"], decoupled=self._decoupled,
            )  # fmt: skip


class AccumAdamW(AccumAdam):
    r"""AccumAdam with decoupled weight decay, as AdamW is to Adam.

    The mixed parameter is first multiplied by :math:`1 - \eta\lambda`, then takes the AccumAdam
    step of :class:`AccumAdam`. Arguments as for :class:`AccumAdam`, with ``weight_decay``
    defaulting to 0.01 (torch.optim.AdamW's default).
    """

    _decoupled = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        accum_iter: int = 4,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        topology: str | Topology = "ring",
        process_group: Any = None,
        bucket_cap_mb: float = 25,
        local_world_size: int | None = None,
        timeout: float | datetime.timedelta | None = None,
        global_avg_every: int | None = None,
    ) -> None:
        super().__init__(
            params, lr, betas, eps, weight_decay, amsgrad, accum_iter=accum_iter,
            foreach=foreach, maximize=maximize, capturable=capturable,
            differentiable=differentiable, fused=fused, topology=topology,
            process_group=process_group, bucket_cap_mb=bucket_cap_mb,
            local_world_size=local_world_size, timeout=timeout, global_avg_every=global_avg_every,
        )  # fmt: skip

"""DecentralizedAdam and DecentralizedAdamW: torch's Adam/AdamW step on mixed parameters."""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from decent_optim._kernels import adam_update_, adam_update_uniform_
from decent_optim._validation import (
    check_betas,
    check_eps,
    check_lr,
    check_unsupported,
    check_weight_decay,
)
from decent_optim.optim._base import DecentralizedOptimizer, _BucketState
from decent_optim.optim._fast import FastBucket
from decent_optim.topologies import Topology

__all__ = ["DecentralizedAdam", "DecentralizedAdamW"]


class DecentralizedAdam(DecentralizedOptimizer):
    r"""Adam whose parameters are also averaged with the topology's neighbours (combine, then adapt).

    .. math::
        x_i \leftarrow \mathrm{AdamStep}\Big(\textstyle\sum_j W^{(t)}_{ij}\, x_j,\; g_i\Big),
        \qquad g_i = \nabla f(x_i;\ \xi_i)

    The neighbours' :math:`x_j` travel while the next forward/backward runs. Weight decay is L2:
    ``weight_decay * x`` of the mixed :math:`x` joins the gradient. With one worker
    :math:`W=[1]` and this is exactly :class:`torch.optim.Adam`. It wants a larger learning rate
    than All-Reduce (1.5-2x in the docs' "Getting All-Reduce quality"); when many workers share
    a fixed global batch and the local batch gets small, use :class:`AccumAdam` with
    ``accum_iter`` = the number of workers, up to 8.

    Args:
        params: parameters or param groups, as for :class:`torch.optim.Adam`.
        lr, betas, eps, weight_decay, amsgrad, maximize: as for :class:`torch.optim.Adam`.
        foreach, fused: accepted for compatibility; the update always runs torch's fused kernel.
        topology: a name (``"complete"``, ``"ring"``, ``"one-peer-exp"``,
            ``"alternating-exp-ring"``) or a :class:`~decent_optim.Topology`.
        process_group: the workers that gossip (default: the world group).
        bucket_cap_mb: size of the flat buckets parameters are packed into.
        local_world_size: workers per node (default: ``LOCAL_WORLD_SIZE`` from torchrun, else 1).
        timeout: seconds (or a ``timedelta``) to wait for a gossip round before raising
            :class:`~decent_optim.gossip.GossipError` naming the round and the peers; default:
            the process group's timeout.
        global_avg_every: also average globally (all-reduce) every this many steps, instead of
            that step's gossip round (Gossip-PGA); default never.

    Example:
        >>> opt = DecentralizedAdam(model.parameters(), lr=1e-3, topology="one-peer-exp")  # doctest: +SKIP

    References:
        Wang, Zhang, Wu, Johansson, "From Promise to Practice: Realizing High-performance
        Decentralized Training", ICLR 2025 (Algorithm 1).
    """

    _decoupled = False

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        *,
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
        check_unsupported(type(self).__name__, capturable=capturable, differentiable=differentiable)
        defaults = dict(
            lr=lr, betas=tuple(float(b) for b in betas), eps=eps, weight_decay=weight_decay,
            amsgrad=amsgrad, maximize=maximize, foreach=foreach, capturable=False,
            differentiable=False, fused=fused, decoupled_weight_decay=self._decoupled,
        )  # fmt: skip
        super().__init__(
            params, defaults, topology=topology, process_group=process_group,
            bucket_cap_mb=bucket_cap_mb, local_world_size=local_world_size, timeout=timeout,
            global_avg_every=global_avg_every,
        )  # fmt: skip

    _fast_counted = True  # one step counter per bucket, on the bucket's device

    def _update_bucket_fast(self, fast: FastBucket, grads: list[Tensor], factor: float) -> bool:
        # After the first step, with the parameters all at the same step: one kernel call on
        # cached lists (or on the flat buffers) and one increment of a shared step vector. The
        # mix's pending factor joins the decoupled decay of the AdamW kernel (Adam without weight
        # decay is AdamW without it), so mixing and updating read and write the bucket once.
        group = self.param_groups[fast.bucket.group_index]
        decoupled = group.get("decoupled_weight_decay", self._decoupled)
        lr, (beta1, beta2) = group["lr"], group["betas"]
        weight_decay, folded = fast.take_factor(
            factor, lr, group["weight_decay"], foldable=decoupled or not group["weight_decay"]
        )
        adam_update_uniform_(
            fast.params, fast.grads(self._gossip, grads), fast.state["exp_avg"],
            fast.state["exp_avg_sq"], fast.state.get("max_exp_avg_sq", []), fast.step_counts,
            lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=weight_decay,
            amsgrad=group["amsgrad"], maximize=group["maximize"], decoupled=decoupled or folded,
        )  # fmt: skip
        return True

    def _flat_state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        extra = ("max_exp_avg_sq",) if group["amsgrad"] else ()
        return ("exp_avg", "exp_avg_sq", *extra)

    def _init_state(self, group: dict[str, Any], state: dict[str, Any], p: Tensor) -> None:
        # float32 on the parameter's device: the layout torch's fused Adam keeps
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)

    def _update(
        self,
        group: dict[str, Any],
        state: _BucketState,
        *,
        grad_scale: Tensor | None,
        found_inf: Tensor | None,
    ) -> None:
        beta1, beta2 = group["betas"]
        adam_update_(
            state.params, state.grads, state.get("exp_avg"), state.get("exp_avg_sq"),
            state.get("max_exp_avg_sq") if group["amsgrad"] else [], state.get("step"),
            lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
            weight_decay=group["weight_decay"], amsgrad=group["amsgrad"],
            maximize=group["maximize"], decoupled=group.get("decoupled_weight_decay", self._decoupled),
            grad_scale=grad_scale, found_inf=found_inf,
        )  # fmt: skip

    def _after_load(self, state: dict[str, Any], p: Tensor) -> None:
        # torch.optim.Adam (not fused) keeps `step` on the CPU; the fused kernel wants it
        # beside the parameter, in float32. Always a copy: torch's loader hands over the
        # state_dict's own tensor, which the kernel would otherwise increment in place.
        if isinstance(state.get("step"), Tensor):
            state["step"] = state["step"].to(dtype=torch.float32, device=p.device, copy=True)


class DecentralizedAdamW(DecentralizedAdam):
    r"""AdamW (decoupled weight decay) on parameters averaged with the topology's neighbours.

    .. math::
        \tilde x_i = \textstyle\sum_j W^{(t)}_{ij}\, x_j, \qquad
        x_i \leftarrow \mathrm{AdamStep}\big((1 - \eta\lambda)\,\tilde x_i,\; g_i\big)

    The drop-in replacement for :class:`torch.optim.AdamW` (same arguments and defaults, plus
    ``topology``); with one worker it is exactly :class:`torch.optim.AdamW`. Arguments as for
    :class:`DecentralizedAdam`, with ``weight_decay`` defaulting to 0.01.

    Example:
        >>> opt = DecentralizedAdamW(model.parameters(), lr=3e-4, weight_decay=0.1,
        ...                          topology="one-peer-exp")  # doctest: +SKIP
    """

    _decoupled = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
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
            params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
            capturable=capturable, differentiable=differentiable, fused=fused, topology=topology,
            process_group=process_group, bucket_cap_mb=bucket_cap_mb,
            local_world_size=local_world_size, timeout=timeout, global_avg_every=global_avg_every,
        )  # fmt: skip

"""DSGD: torch.optim.SGD applied to parameters mixed with the topology's neighbours."""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import Any

from torch import Tensor

from decent_optim._kernels import sgd_update_
from decent_optim._validation import check_lr, check_momentum, check_unsupported, check_weight_decay
from decent_optim.optim._base import DecentralizedOptimizer, _BucketState
from decent_optim.optim._fast import FastBucket
from decent_optim.topologies import Topology

__all__ = ["DSGD"]


class DSGD(DecentralizedOptimizer):
    r"""Decentralized SGD: average with the neighbours, then take a :class:`torch.optim.SGD` step.

    .. math::
        x_i \leftarrow \mathrm{SGDStep}\Big(\textstyle\sum_j W^{(t)}_{ij}\, x_j,\; g_i\Big),
        \qquad g_i = \nabla f(x_i;\ \xi_i)

    Momentum, dampening, Nesterov, L2 weight decay (of the mixed parameters) and ``maximize``
    behave as in torch; with ``momentum=0`` this is D-PSGD (Lian et al., 2017). The neighbours'
    values travel while the next forward/backward runs. With one worker :math:`W=[1]` and this is
    exactly :class:`torch.optim.SGD`.

    Args:
        params: parameters or param groups, as for :class:`torch.optim.SGD`.
        lr, momentum, dampening, weight_decay, nesterov, maximize: as for :class:`torch.optim.SGD`.
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
        >>> opt = DSGD(model.parameters(), lr=0.1, momentum=0.9, topology="ring")  # doctest: +SKIP

    References:
        Lian et al., "Can Decentralized Algorithms Outperform Centralized Algorithms?", NeurIPS 2017.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
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
        check_momentum(momentum, dampening, nesterov)
        check_weight_decay(weight_decay)
        check_unsupported(type(self).__name__, differentiable=differentiable)
        defaults = dict(
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
            nesterov=nesterov, maximize=maximize, foreach=foreach, differentiable=False,
            fused=fused,
        )  # fmt: skip
        super().__init__(
            params, defaults, topology=topology, process_group=process_group,
            bucket_cap_mb=bucket_cap_mb, local_world_size=local_world_size, timeout=timeout,
            global_avg_every=global_avg_every,
        )  # fmt: skip

    def _flat_state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["momentum"] else ()

    # torch's fused SGD costs only a few microseconds per tensor on CPUs, about what copying
    # the gradients into a flat buffer costs (measured: 600 tensors, 2.5M parameters, 2 cores:
    # 3.5 ms on the lists, 4.3 ms flat), so the kernel always runs on the per-parameter lists
    _fast_flatten = False

    def _update_bucket_fast(self, fast: FastBucket, grads: list[Tensor], factor: float) -> bool:
        # Once every parameter has its momentum buffer in the flat buffers (from the second step;
        # at once without momentum): one fused SGD call on the cached per-parameter lists.
        # Without momentum the mix's pending factor folds into the L2 decay, because then
        # p - lr (g + w p) = (1 - lr w) p - lr g; with momentum, w p would enter the buffer.
        group = self.param_groups[fast.bucket.group_index]
        momentum, lr = group["momentum"], group["lr"]
        weight_decay, _ = fast.take_factor(factor, lr, group["weight_decay"], foldable=not momentum)
        sgd_update_(
            fast.params, fast.grads(self._gossip, grads), fast.state.get("momentum_buffer", []),
            lr=lr, momentum=momentum, dampening=group["dampening"], weight_decay=weight_decay,
            nesterov=group["nesterov"], maximize=group["maximize"], first_step=False,
        )  # fmt: skip
        return True

    def _update(
        self,
        group: dict[str, Any],
        state: _BucketState,
        *,
        grad_scale: Tensor | None,
        found_inf: Tensor | None,
    ) -> None:
        momentum = group["momentum"]
        # torch starts a momentum buffer at the gradient itself: run the new ones separately
        parts = [state.split(state.fresh), state.split([not f for f in state.fresh])]
        for first_step, part in zip((True, False), parts):
            if part.params:
                sgd_update_(
                    part.params, part.grads,
                    part.get("momentum_buffer") if momentum else [],
                    lr=group["lr"], momentum=momentum, dampening=group["dampening"],
                    weight_decay=group["weight_decay"], nesterov=group["nesterov"],
                    maximize=group["maximize"], first_step=first_step, grad_scale=grad_scale,
                    found_inf=found_inf,
                )  # fmt: skip

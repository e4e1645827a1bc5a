"""DecentralizedAdam and DecentralizedAdamW: torch's Adam/AdamW step on mixed parameters."""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import Any, cast

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
from decent_optim.flat import Bucket
from decent_optim.gossip import Gossiper, LocalGossiper
from decent_optim.optim._base import DecentralizedOptimizer, _BucketState
from decent_optim.topologies import Topology

__all__ = ["DecentralizedAdam", "DecentralizedAdamW"]


class DecentralizedAdam(DecentralizedOptimizer):
    r"""Adam whose parameters are also averaged with the topology's neighbours (combine, then adapt).

    .. math::
        x_i \leftarrow \mathrm{AdamStep}\Big(\textstyle\sum_j W^{(t)}_{ij}\, x_j,\; g_i\Big),
        \qquad g_i = \nabla f(x_i;\ \xi_i)

    The neighbours' :math:`x_j` travel while the next forward/backward runs. Weight decay is L2:
    ``weight_decay * x`` of the mixed :math:`x` joins the gradient. With one worker
    :math:`W=[1]` and this is exactly :class:`torch.optim.Adam`.

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
        self._fast: dict[int, _FastBucket] = {}  # bucket index -> its cached update lists

    def _update_bucket_fast(self, index: int, bucket: Bucket, group: dict[str, Any]) -> bool:
        # After the first step, when every parameter of the bucket has a gradient and all are at
        # the same step, the update is one kernel call on cached lists (or on the flat buffers)
        # and one increment of a shared step vector: no per-parameter state lookups.
        if (
            getattr(self, "grad_scale", None) is not None  # set by torch's GradScaler.step
            or getattr(self, "found_inf", None) is not None
            or torch.compiler.is_compiling()  # cached Python lists: leave tracing to the general path
        ):
            return False
        maybe_grads = [p.grad for p in bucket.params]
        if any(g is None for g in maybe_grads):
            self._fast.pop(index, None)  # these parameters skip a step: counts will differ
            return False
        grads = cast(list[Tensor], maybe_grads)
        fast = self._fast.get(index)
        if fast is None or not fast.valid(self.state, bucket.params, group["amsgrad"]):
            fast = self._fast[index] = _FastBucket.build(self, index, bucket, group)
        if not fast.uniform:
            return False
        if fast.flat:
            torch._foreach_copy_(fast.grad_buffer(self._gossip, index, bucket), grads)
            grads = [cast(Tensor, fast.flat_grad)]  # set by grad_buffer
        beta1, beta2 = group["betas"]
        adam_update_uniform_(
            fast.params, grads, fast.exp_avgs, fast.exp_avg_sqs, fast.max_exp_avg_sqs,
            fast.step_counts, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
            weight_decay=group["weight_decay"], amsgrad=group["amsgrad"],
            maximize=group["maximize"], decoupled=group.get("decoupled_weight_decay", self._decoupled),
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


#: On CPUs, torch's fused Adam costs tens of microseconds per tensor on top of the memory
#: traffic; below this mean tensor size (elements) copying the gradients into one flat buffer and
#: running the kernel once on the whole bucket is faster. GPUs batch tensors in one launch.
_FLATTEN_BELOW_NUMEL = 1 << 16


class _FastBucket:
    """The lists one Adam update of a bucket needs, built once; see ``_update_bucket_fast``.

    ``uniform`` is False when the parameters are at different steps (some skipped steps); then
    the general path runs. The per-parameter ``state["step"]`` tensors are re-pointed to entries
    of ``step_counts`` so that one addition advances them all; ``valid`` notices when the state
    was replaced since (e.g. by ``load_state_dict``).
    """

    amsgrad: bool
    exp_avg_sqs: list[Tensor]
    exp_avgs: list[Tensor]
    flat: bool
    flat_grad: Tensor | None
    grad_views: list[Tensor]
    max_exp_avg_sqs: list[Tensor]
    own_grad: Tensor | None
    params: list[Tensor]
    step_counts: Tensor
    step_views: list[Any]
    uniform: bool

    def grad_buffer(
        self, gossip: Gossiper | LocalGossiper, index: int, bucket: Bucket
    ) -> list[Tensor]:
        """Per-parameter views of a flat buffer for the gradients; returns the views.

        The buffer is the gossip's idle receive buffer of this bucket when there is one (free
        between mixing and the next launch), so the flat update costs no extra memory.
        """
        buf = gossip.idle_buffer(index, bucket.data)
        if buf is None:
            if self.own_grad is None:
                self.own_grad = torch.empty_like(bucket.data)
            buf = self.own_grad
        if buf is not self.flat_grad:
            self.flat_grad, self.grad_views = buf, bucket.views(buf)
        return self.grad_views

    def valid(self, state: Any, params: list[Tensor], amsgrad: bool) -> bool:
        return amsgrad == self.amsgrad and all(
            state[p].get("step") is s for p, s in zip(params, self.step_views)
        )

    @classmethod
    def build(cls, opt: DecentralizedAdam, index: int, bucket: Bucket, group: dict) -> _FastBucket:
        self = cls()
        self.amsgrad = group["amsgrad"]
        self.uniform = False
        states = [opt.state[p] for p in bucket.params]
        self.step_views = [st.get("step") for st in states]
        keys = opt._flat_state_keys(group)
        views = {key: opt._flat_views(index, bucket, key) for key in keys}
        steps = self.step_views
        if any(not isinstance(s, Tensor) or s.device != bucket.device for s in steps) or any(
            st.get(k) is not v for k in keys for st, v in zip(states, views[k])
        ):
            return self  # state not created yet (first step) or not in the flat buffers
        counts = torch.stack([s.detach().reshape(()).to(torch.float32) for s in steps])
        if not bool((counts == counts[0]).all()):
            return self
        self.step_counts = counts
        self.step_views = [counts[k] for k in range(len(states))]
        for st, s in zip(states, self.step_views):
            st["step"] = s
        if bucket.device.type == "cpu" and bucket.numel < _FLATTEN_BELOW_NUMEL * len(bucket.params):
            flat = {k: opt._flat_buffer(index, bucket, k)[0] for k in keys}
            self.params = [bucket.data]
            self.exp_avgs, self.exp_avg_sqs = [flat["exp_avg"]], [flat["exp_avg_sq"]]
            self.max_exp_avg_sqs = [flat["max_exp_avg_sq"]] if self.amsgrad else []
            self.flat, self.flat_grad, self.own_grad = True, None, None
        else:
            self.params = list(bucket.params)
            self.exp_avgs, self.exp_avg_sqs = views["exp_avg"], views["exp_avg_sq"]
            self.max_exp_avg_sqs = views["max_exp_avg_sq"] if self.amsgrad else []
            self.flat = False
        self.uniform = True
        return self


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

"""AccumAdam and AccumAdamW: Adam whose moment estimates are refreshed every few steps."""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from decent_optim._kernels import (
    accum_adam_refresh_,
    accum_adam_step_,
    accum_adam_update_,
)
from decent_optim._validation import (
    check_accum_iter,
    check_betas,
    check_eps,
    check_lr,
    check_unsupported,
    check_weight_decay,
)
from decent_optim.flat import Bucket
from decent_optim.optim._base import DecentralizedOptimizer, _BucketState
from decent_optim.optim._fast import FastBucket
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

    ``accum_iter`` grows with the number of workers sharing a fixed global batch: the number of
    workers, up to 8 (1 is Adam, for large local batches). The bases decay once per refresh, so
    they remember about ``accum_iter / (1 - beta1)`` steps: warm the learning rate up for at
    least three times that, and raise ``beta2`` a little (``(0.9, 0.98)`` where AdamW would use
    ``(0.9, 0.95)``) rather than raising the betas to the power ``accum_iter``. Docs: "Getting
    All-Reduce quality".

    The state keys ``exp_avg`` and ``exp_avg_sq`` hold :math:`\bar m` and :math:`\bar v`;
    ``grad_acc`` holds the running mean gradient of the current window.

    Args:
        params: parameters or param groups, as for :class:`torch.optim.Adam`.
        lr, betas, eps, weight_decay, amsgrad, maximize: as for :class:`torch.optim.Adam`.
        accum_iter: steps per refresh of the moment bases (the paper's :math:`s`).
        foreach, fused: accepted for compatibility; after the first step the update runs
            torch's fused Adam kernel (on copies of the moment bases), else foreach kernels.
        topology, process_group, bucket_cap_mb, local_world_size, timeout, global_avg_every: as for
            :class:`DecentralizedAdam`.

    Example:
        >>> opt = AccumAdam(model.parameters(), lr=2e-3, betas=(0.9, 0.98),
        ...                 accum_iter=min(world_size, 8), topology="ring")  # doctest: +SKIP

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

    _fast_counted, _fast_step_device, _fast_flatten = True, torch.device("cpu"), False

    def _update_bucket_fast(self, fast: FastBucket, grads: list[Tensor], factor: float) -> bool:
        # After the first step, with the parameters all at the same step: the bucket is taken
        # a third at a time. The scratch buffer (the idle gossip receive buffer) holds that
        # third's gradients and the moments m_t, v_t formed from copies of the bases, and
        # torch's fused Adam kernel updates parameters and moments in one pass; the bases stay
        # untouched until the window ends. Per element a step moves 2 + 4 + 7 + 3 words
        # (gather the gradient, copy the bases, the kernel, accumulate the gradient) instead of
        # about 25, and no parameter-sized temporaries are allocated.
        bucket = fast.bucket
        if fast.extra is None:
            if bucket.numel < 3:
                return False  # too small to cut in three; nothing to gain either
            fast.extra = _Pieces(bucket, fast.flat_state)
        pieces: _Pieces = fast.extra
        if not pieces.gradients_fit(grads):
            return False
        group = self.param_groups[bucket.group_index]
        lr, (beta1, beta2), accum_iter = float(group["lr"]), group["betas"], group["accum_iter"]
        weight_decay, folded = fast.take_factor(
            factor, lr, group["weight_decay"], foldable=self._decoupled or not group["weight_decay"]
        )
        fast.step += 1
        fast.step_counts.add_(1)
        pieces.step.fill_(-(-fast.step // accum_iter))  # k = ceil(t / accum_iter)
        scratch = fast.scratch(self._gossip)
        for piece, (grad_views, grad, m, v) in zip(pieces.pieces, pieces.scratch_views(scratch)):
            accum_adam_step_(
                piece.param, piece.gather(grads, grad_views, grad), piece.exp_avg,
                piece.exp_avg_sq, piece.grad_acc, piece.max_exp_avg_sq, (m, v), pieces.step,
                lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=weight_decay,
                maximize=group["maximize"], decoupled=self._decoupled or folded,
                accum_iter=accum_iter,
            )  # fmt: skip
        if fast.step % accum_iter == 0:
            flat = fast.flat_state
            accum_adam_refresh_(
                [flat["exp_avg"]], [flat["exp_avg_sq"]], [flat["grad_acc"]], beta1=beta1,
                beta2=beta2,
            )  # fmt: skip
        return True

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


class _Piece:
    """One stretch ``[start, stop)`` of a bucket, with its slices of the flat buffers.

    Its gradient is either read in place (``direct``: the stretch lies inside one parameter)
    or gathered into the scratch buffer: the parameters ``first..last-1`` lie wholly inside
    and are copied with one foreach call, ``parts`` are the stretches of the (at most two)
    parameters that cross its ends, ``(param, lo, hi, to)``, in memory order.
    """

    def __init__(self, bucket: Bucket, flat_state: dict[str, Tensor], start: int, stop: int):
        self.start, self.stop = start, stop
        self.param = bucket.data[start:stop]
        self.exp_avg = flat_state["exp_avg"][start:stop]
        self.exp_avg_sq = flat_state["exp_avg_sq"][start:stop]
        self.grad_acc = flat_state["grad_acc"][start:stop]
        maxed = flat_state.get("max_exp_avg_sq")
        self.max_exp_avg_sq = None if maxed is None else maxed[start:stop]
        ends = [(off, off + p.numel()) for p, off in zip(bucket.params, bucket.offsets)]
        inside = [k for k, (a, b) in enumerate(ends) if start <= a and b <= stop]
        self.first, self.last = (inside[0], inside[-1] + 1) if inside else (0, 0)
        cover = [k for k, (a, b) in enumerate(ends) if a <= start and stop <= b and a < b]
        self.direct = (
            (cover[0], start - ends[cover[0]][0], stop - ends[cover[0]][0]) if cover else None
        )
        self.parts = [
            (k, max(a, start) - a, min(b, stop) - a, max(a, start) - start)
            for k, (a, b) in enumerate(ends)
            if not cover and a < stop and b > start and not (start <= a and b <= stop)
        ]

    def gather(self, grads: list[Tensor], views: list[Tensor], buf: Tensor) -> Tensor:
        """This stretch's gradient, flat: in place, or copied into ``buf`` (``views`` of it)."""
        if self.direct is not None:
            k, lo, hi = self.direct
            return _memory_order(grads[k])[lo:hi]
        if self.last > self.first:
            torch._foreach_copy_(views, grads[self.first : self.last])
        for k, lo, hi, to in self.parts:
            buf[to : to + hi - lo].copy_(_memory_order(grads[k])[lo:hi])
        return buf


class _Pieces:
    """A bucket cut into stretches of at most a third of its length (AccumAdam's fast path).

    A bucket-sized scratch buffer then holds one stretch's gathered gradient and both of its
    moments at once. Parameters that cross a cut have their gradients read by memory position,
    which needs the gradient laid out like the parameter (autograd's layout contract);
    :meth:`gradients_fit` checks that.
    """

    def __init__(self, bucket: Bucket, flat_state: dict[str, Tensor]) -> None:
        self.bucket = bucket
        self.length = length = bucket.numel // 3
        self.pieces = [
            _Piece(bucket, flat_state, a, min(a + length, bucket.numel))
            for a in range(0, bucket.numel, length)
        ]
        cut = {k for p in self.pieces for k, *_ in p.parts}
        cut |= {p.direct[0] for p in self.pieces if p.direct is not None}
        self.cut = [(k, bucket.params[k].stride()) for k in sorted(cut)]
        self.step = torch.zeros((), dtype=torch.float32, device=bucket.device)  # k = ceil(t/s)
        self._views_of: Tensor | None = None
        self._views: list[tuple[list[Tensor], Tensor, Tensor, Tensor]] = []

    def gradients_fit(self, grads: list[Tensor]) -> bool:
        return all(grads[k].stride() == stride for k, stride in self.cut)

    def scratch_views(self, buf: Tensor) -> list[tuple[list[Tensor], Tensor, Tensor, Tensor]]:
        """Per piece: views of ``buf`` for its whole parameters' gradients, and the flat
        gradient, first and second moment regions (thirds of ``buf``)."""
        if buf is not self._views_of:
            n, views = self.length, []
            for p in self.pieces:
                size = p.stop - p.start
                whole = [
                    self.bucket.view_of(
                        buf, self.bucket.params[k], self.bucket.offsets[k] - p.start
                    )
                    for k in range(p.first, p.last)
                ]
                views.append((whole, buf[:size], buf[n : n + size], buf[2 * n : 2 * n + size]))
            self._views_of, self._views = buf, views
        return self._views


def _memory_order(t: Tensor) -> Tensor:
    """A dense tensor's elements as one flat view, in the order they lie in memory."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


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

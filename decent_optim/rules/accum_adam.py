r"""AccumAdam as an update rule: Adam whose moment bases are refreshed every ``accum_iter`` steps.

Math: see :class:`decent_optim.AccumAdam`. State: ``exp_avg`` and ``exp_avg_sq`` hold the bases
:math:`\bar m, \bar v`, ``grad_acc`` the running mean gradient of the current window, ``step``
the steps taken (the paper's official code keeps :math:`\beta_1 \bar m` and :math:`\beta_2 \bar v`
instead; the arithmetic is the same). A step runs one of two forms of the same arithmetic:

* :func:`accum_adam_math_`, the math in elementwise operations. For a whole bucket it is compiled
  (:class:`~decent_optim.rules.compiled.CompiledStep`) into one pass over memory that also adds a
  pair's peer values; uncompiled, it steps single parameters when only some of a bucket have
  gradients or their step counts differ, and it is what a traced step (``torch.compile``) sees.
* eager whole buckets: the step reduces to Adam's -- torch's fused Adam kernel run on *copies* of
  the bases, with the bias corrections of the refresh count :math:`k`, computes :math:`m_t, v_t`
  and the parameter step in one pass -- taken a slice of the flat bucket at a time, so the copies
  need two small buffers, not two parameter-sized ones.

At the end of a window the bases take one moment step with the mean gradient (:func:`refresh_`).
With a ``GradScaler`` the step reads ``found_inf`` and the scale once (the window's count must
not advance on a skipped step), then takes the same paths.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from decent_optim.flat import Bucket
from decent_optim.gossip.handle import PendingMix
from decent_optim.rules.adam import fused_adam_
from decent_optim.rules.base import Amp, Batch, UpdateRule, finish_mix
from decent_optim.rules.compiled import CompiledStep

__all__ = ["AccumAdamRule", "accum_adam_math_", "refresh_"]

#: elements per slice of the eager whole-bucket step. On a CPU the two copies of the bases stay
#: in cache. A GPU launches about ten kernels per slice at several microseconds each, so its
#: slices are larger (16 MB per float32 copy, within an H100's 50 MB of L2): at 2**18 a 125M
#: model's step took 12.8x torch's fused AdamW on an H100, nearly all of it launches.
SLICE = {"cpu": 1 << 18, "cuda": 1 << 22}


def _slice_len(device: torch.device) -> int:
    return SLICE.get(device.type, SLICE["cuda"])


class AccumAdamRule(UpdateRule):
    """AccumAdam with L2 or decoupled (``decoupled_weight_decay``) weight decay, per param group."""

    def __init__(self) -> None:
        self._compiled = CompiledStep(accum_adam_math_)
        self._slices: dict[tuple[torch.device, torch.dtype], tuple[Tensor, Tensor, Tensor]] = {}

    def keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        bases = ("exp_avg", "exp_avg_sq", "grad_acc")
        return (*bases, "max_exp_avg_sq") if group["amsgrad"] else bases

    def _compiles(self, bucket: Bucket, group: dict[str, Any]) -> bool:
        return self._compiled.usable(group["fused"], bucket.device, bucket.numel)

    def flatten(self, bucket: Bucket, group: dict[str, Any]) -> bool:
        # The eager step slices the flat bucket. Compiled, each call costs its guards and launch
        # on the host (tens of microseconds on a CPU, over a hundred on a GPU, where it leaves
        # the device idle): a GPU copies the gradients into one buffer in far less, a CPU only
        # for buckets of small tensors.
        if not self._compiles(bucket, group) or bucket.device.type == "cuda":
            return True
        return bucket.numel < (1 << 16) * len(bucket.params)

    def update(self, batch: Batch, group: dict[str, Any], *, mix: PendingMix, amp: Amp) -> None:
        skip, unscale = _read_amp(amp)
        if skip:  # GradScaler found inf/NaN: no update, no count (the gossip still runs)
            mix.apply_(batch.bucket.data)
            return
        step = batch.step
        if step is None and batch.whole:  # unknown on the host after a GradScaler step, or unequal
            counts = torch.stack(batch.steps).tolist()
            step = int(counts[0]) if all(c == counts[0] for c in counts) else None
        compiles = self._compiles(batch.bucket, group)
        if step is None or not (batch.flat or compiles):
            self._update_each(batch, group, mix, unscale)
            return
        t = step + 1
        batch.advance_steps()
        if compiles:
            self._run_compiled(batch, mix, _scalars(group, t, unscale))
        else:
            self._update_sliced(batch, group, mix, t, amp.grad_scale, unscale)

    def _run_compiled(self, batch: Batch, mix: PendingMix, scalars: dict[str, Any]) -> None:
        """The compiled step: one call on the flat bucket, or one per parameter.

        Per parameter, a pair round's peer values are added inside the kernel, so each element
        moves once; a flat batch's gradients were gathered into the receive buffer, so the peer's
        values are added first.
        """
        bucket = batch.bucket
        keys = ("exp_avg", "exp_avg_sq", "grad_acc", "max_exp_avg_sq")
        state = [bucket.state(key)[0] if key in batch.state else None for key in keys]
        if batch.flat:
            mix = mix.sum_into_(bucket.data)  # (the engine did, to lend the receive buffer)
            parts = [(0, bucket.numel, batch.grads[0])]
        else:
            parts = []
            for p, g, offset in zip(bucket.targets, batch.grads, bucket.offsets):
                if g.stride() != p.stride():  # read it in memory order, like the parameter
                    g = torch.empty_like(p).copy_(g)
                parts.append((offset, offset + p.numel(), g))
        for a, b, grad in parts:
            # Plain aliases of memory (not views): the compiled kernel then does not guard on
            # the shapes the views came from, and one kernel serves every parameter
            args: list[Tensor | None] = [_alias(bucket.data, a, b), _alias(grad, 0, b - a)]
            args += [None if t is None else _alias(t, a, b) for t in (*state, mix.addend)]
            if not self._compiled.run(bucket.device, *args, factor=mix.factor, **scalars):
                accum_adam_math_(*args, factor=mix.factor, **scalars)  # type: ignore[arg-type]
        torch.autograd.graph.increment_version(bucket.data)  # written through the aliases

    def _update_sliced(
        self,
        batch: Batch,
        group: dict[str, Any],
        mix: PendingMix,
        t: int,
        grad_scale: Tensor | None,
        unscale: float,
    ) -> None:
        bucket, s = batch.bucket, group["accum_iter"]
        decoupled, weight_decay = group["decoupled_weight_decay"], group["weight_decay"]
        decay, folded = finish_mix(
            batch,
            mix,
            lr=group["lr"],
            weight_decay=weight_decay,
            foldable=decoupled or not weight_decay,
        )
        alpha = (-unscale if group["maximize"] else unscale) / s
        l2 = 0.0 if decoupled or folded else weight_decay / s
        m_copy, v_copy, count = self._slice_buffers(bucket)
        count.fill_(-(-t // s))  # bias corrections of the refresh count k
        param, grad = bucket.data, batch.grads[0]
        state = {key: bucket.state(key)[0] for key in batch.state}
        vmax = state.get("max_exp_avg_sq")
        span = _slice_len(bucket.device)
        for a in range(0, bucket.numel, span):
            b = min(a + span, bucket.numel)
            m, v = m_copy[: b - a], v_copy[: b - a]
            state["grad_acc"][a:b].add_(grad[a:b], alpha=alpha)
            if l2:  # the gradient the bases see includes L2 decay of the mixed parameter
                state["grad_acc"][a:b].add_(param[a:b], alpha=l2)
            m.copy_(state["exp_avg"][a:b])
            v.copy_(state["exp_avg_sq"][a:b])
            fused_adam_(
                [param[a:b]],
                [grad[a:b]],
                [m],
                [v],
                [] if vmax is None else [vmax[a:b]],
                [count],
                group,
                weight_decay=decay,
                decoupled=decoupled or folded,
                amp=Amp(grad_scale=grad_scale),
            )
        if t % s == 0:
            bases = [state[key] for key in ("exp_avg", "exp_avg_sq", "grad_acc")]
            refresh_(*bases, beta1=group["betas"][0], beta2=group["betas"][1])

    def _slice_buffers(self, bucket: Bucket) -> tuple[Tensor, Tensor, Tensor]:
        key = (bucket.device, bucket.dtype)
        found = self._slices.get(key)
        span = _slice_len(bucket.device)
        if found is None or found[0].numel() < min(bucket.numel, span):
            size = min(max(bucket.numel, 1), span)
            found = self._slices[key] = (
                torch.empty(size, dtype=bucket.dtype, device=bucket.device),
                torch.empty(size, dtype=bucket.dtype, device=bucket.device),
                torch.zeros((), dtype=torch.float32, device=bucket.device),
            )
        return found

    def _update_each(
        self, batch: Batch, group: dict[str, Any], mix: PendingMix, unscale: float
    ) -> None:
        """Parameter by parameter: some parameters of a bucket, unequal counts, or a traced step."""
        mix.apply_(batch.bucket.data)
        counts = [int(c) for c in torch.stack(batch.steps).tolist()]  # one device read
        batch.advance_steps()
        for k, count in enumerate(counts):
            m, v, acc = (batch.state[key][k] for key in ("exp_avg", "exp_avg_sq", "grad_acc"))
            vmax = batch.state["max_exp_avg_sq"][k] if "max_exp_avg_sq" in batch.state else None
            scalars = _scalars(group, count + 1, unscale)
            p, g = batch.params[k], batch.grads[k]
            accum_adam_math_(p, g, m, v, acc, vmax, None, factor=1.0, **scalars)


def _read_amp(amp: Amp) -> tuple[bool, float]:
    """``(skip the step, 1 / grad_scale)`` of a GradScaler step, read in one device transfer."""
    if not amp.active:
        return False, 1.0
    values = [
        torch.zeros(()) if amp.found_inf is None else amp.found_inf.float().reshape(()),
        torch.ones(()) if amp.grad_scale is None else amp.grad_scale.float().reshape(()),
    ]
    found_inf, scale = (float(v) for v in torch.stack([v.cpu() for v in values]).tolist())
    return found_inf != 0, 1.0 / scale


def _scalars(group: dict[str, Any], t: int, unscale: float) -> dict[str, Any]:
    """The scalars of :func:`accum_adam_math_` for step ``t`` (counting from 1)."""
    s, (beta1, beta2) = group["accum_iter"], group["betas"]
    k = -(-t // s)  # refreshes so far, counting the one at the end of this window
    lr = float(group["lr"])
    return dict(
        decoupled=group["decoupled_weight_decay"],
        weight_decay=group["weight_decay"],
        decay=1 - lr * group["weight_decay"],
        grad_factor=-unscale if group["maximize"] else unscale,
        beta1=beta1,
        beta2=beta2,
        eps=group["eps"],
        step_size=lr / (1 - beta1**k),
        bias2_rsqrt=1 / math.sqrt(1 - beta2**k),
        inv_s=1 / s,
        refresh=t % s == 0,
    )


def accum_adam_math_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    grad_acc: Tensor,
    max_exp_avg_sq: Tensor | None,
    addend: Tensor | None,
    *,
    factor: float,
    decoupled: bool,
    weight_decay: float,
    decay: float,
    grad_factor: float,
    beta1: float,
    beta2: float,
    eps: float,
    step_size: float,
    bias2_rsqrt: float,
    inv_s: float,
    refresh: bool,
) -> None:
    """One AccumAdam step of one tensor; with ``refresh``, also the end of the window.

    The parameter is first mixed, ``(param + addend) * factor``; the gradient is
    ``grad * grad_factor`` (the sign of ``maximize`` and a GradScaler's unscaling). The bias
    corrections of the refresh count ``k`` come as ``step_size = lr / (1 - beta1**k)`` and
    ``bias2_rsqrt = 1 / sqrt(1 - beta2**k)``: per-element divisions cost several multiplications'
    time. Decoupled decay comes as ``decay = 1 - lr * weight_decay``. Every scalar that changes
    from step to step is computed by the caller and only multiplies tensors here: arithmetic
    between two such floats inside a compiled function makes dynamo specialize on their values
    (seen with torch 2.11 on CUDA), and a scheduled rate would then recompile at every step.
    Math: see :class:`decent_optim.AccumAdam`.
    """
    # bf16/fp16 tensors are read into float32 and rounded once, when written back, as torch's
    # fused Adam does (and inductor's kernel anyway): rounding after every operation would
    # lose the moments' decay (0.999 v rounds back to v in bf16)
    p32, g32 = _opmath(param), _opmath(grad)
    x = (p32 if addend is None else p32 + _opmath(addend)) * factor
    g = g32 * grad_factor
    if decoupled:
        decayed = x * decay
    else:
        g = g + weight_decay * x
        decayed = x
    m_base, v_base = _opmath(exp_avg), _opmath(exp_avg_sq)
    m = m_base * beta1 + g * (1 - beta1)
    v = v_base * beta2 + g * g * (1 - beta2)
    if max_exp_avg_sq is not None:
        v = torch.maximum(_opmath(max_exp_avg_sq), v)
        max_exp_avg_sq.copy_(v)
    param.copy_(decayed - step_size * m / (v.sqrt() * bias2_rsqrt + eps))
    acc = _opmath(grad_acc) + g * inv_s
    if refresh:  # the window ends: the bases move, in the same pass
        exp_avg.copy_(m_base * beta1 + acc * (1 - beta1))
        exp_avg_sq.copy_(v_base * beta2 + acc * acc * (1 - beta2))
        grad_acc.zero_()
    else:
        grad_acc.copy_(acc)


def refresh_(
    exp_avg: Tensor, exp_avg_sq: Tensor, grad_acc: Tensor, *, beta1: float, beta2: float
) -> None:
    """End of a window: the bases take one moment step with the mean gradient, which restarts.

    Math: see :class:`decent_optim.AccumAdam`.
    """
    if exp_avg.dtype in _LOW_PRECISION:  # one rounding per value (see accum_adam_math_)
        g, m, v = (t.float() for t in (grad_acc, exp_avg, exp_avg_sq))
        exp_avg.copy_(m.mul_(beta1).add_(g, alpha=1 - beta1))
        exp_avg_sq.copy_(v.mul_(beta2).addcmul_(g, g, value=1 - beta2))
    else:
        exp_avg.mul_(beta1).add_(grad_acc, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad_acc, grad_acc, value=1 - beta2)
    grad_acc.zero_()


_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _opmath(t: Tensor) -> Tensor:
    """``t`` in float32 if it is bf16 or fp16, else itself: the precision the step computes in."""
    return t.float() if t.dtype in _LOW_PRECISION else t


def _alias(t: Tensor, start: int, stop: int) -> Tensor:
    """Elements ``[start, stop)`` of dense ``t`` in memory order, as a tensor of their own.

    It shares ``t``'s memory but has no view history (``_base``), so a compiled kernel sees a
    plain one-dimensional input whatever shape the memory came from.
    """
    alias = torch.empty((0,), dtype=t.dtype, device=t.device)
    return alias.set_(t.untyped_storage(), t.storage_offset() + start, (stop - start,), (1,))

"""``opt.state`` kept in the buckets' flat buffers, and the batches an update rule steps.

Every state tensor of a parameter (``opt.state[p]["exp_avg"]``, its ``step``) is a view of its
bucket's flat buffers (:meth:`Bucket.state <decent_optim.flat.Bucket.state>`), so the rule updates
a whole bucket in one kernel call while the state looks to torch tools exactly like
torch.optim's. Writes through ``opt.state`` are noticed: the dicts report them
(:mod:`~decent_optim.optim.watched`), and before the next update every replaced value --
a tensor set by hand, a whole entry, or what ``load_state_dict`` put there -- is copied into the
flat buffers, and the entry points at its view again. Nothing written is ignored; a value that
cannot be that state (another shape, a step count that is not a whole number >= 0) raises,
naming the parameter and the key. New state starts at zero.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from decent_optim import sharded
from decent_optim.flat import Bucket
from decent_optim.gossip.handle import NO_MIX, PendingMix
from decent_optim.optim.watched import ParamState, StateDict
from decent_optim.rules.base import Batch, UpdateRule

__all__ = ["FlatState"]


class _Counts:
    """What the engine knows of one bucket's step counters without reading the device."""

    __slots__ = ("step", "uniform")

    def __init__(self) -> None:
        self.uniform: bool | None = True  # all counters equal (None: unknown)
        self.step: int | None = 0  # their common value, when known on the host


class FlatState:
    """Binds ``opt.state`` to the buckets and builds each step's :class:`Batch` per bucket.

    Args:
        buckets: the optimizer's buckets.
        rule: the update rule (its state keys, whether it counts steps, whether it flattens).
    """

    def __init__(self, buckets: list[Bucket], rule: UpdateRule) -> None:
        self.buckets, self.rule = buckets, rule
        self.stale = False  # something was written through opt.state since the last check
        self._keys: list[tuple[str, ...] | None] = [None] * len(buckets)  # bound for all params
        self._bound = [[False] * len(b.params) for b in buckets]  # param has flat state
        self._counts = [_Counts() for _ in buckets]
        self._scratch: dict[int, Tensor] = {}  # own flat-gradient buffers, when gossip lends none
        self._scratch_uses: dict[int, int] = {}
        self._grad_views: dict[int, tuple[Tensor, list[Tensor]]] = {}

    def notify(self) -> None:
        self.stale = True

    def wrap(self, state: dict[Any, Any]) -> StateDict:
        """``state`` as a :class:`StateDict` reporting to this object (marked stale)."""
        self.stale = True
        return StateDict(self.notify, state.items())

    # -- binding --------------------------------------------------------------------------------
    def rebind(self, state: dict[Any, Any], groups: list[dict[str, Any]]) -> None:
        """Copy every value written through ``state`` into the flat buffers, and re-point it."""
        self.stale = False
        for index, bucket in enumerate(self.buckets):
            keys = self.rule.keys(groups[bucket.group_index])
            bound = self._bound[index]
            for k, p in enumerate(bucket.params):
                entry = state.get(p)
                bound[k] = bool(entry)
                if entry:
                    self._adopt(bucket, k, entry, keys)
            self._keys[index] = keys
            self._counts[index].uniform = None

    def _adopt(self, bucket: Bucket, k: int, entry: dict[str, Any], keys: tuple[str, ...]) -> None:
        p = bucket.params[k]
        for key in keys:
            view, public = bucket.state(key)[1][k], bucket.shown(key)[k]
            value = entry.get(key)
            if value is public:
                continue
            if value is None:
                view.zero_()  # e.g. max_exp_avg_sq once amsgrad is switched on
            elif not isinstance(value, Tensor) or value.shape != p.shape:
                got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise ValueError(
                    f"optimizer state {key!r} of a parameter of shape {tuple(p.shape)} must be a "
                    f"tensor of that shape, got {got}"
                )
            else:
                view.copy_(sharded.local(value))
            dict.__setitem__(entry, key, public)
        if self.rule.counts_steps:
            view = bucket.steps()[1][k]
            value = entry.get("step")
            if value is not view:
                view.fill_(_step_count(value, p))
                dict.__setitem__(entry, "step", view)

    def _bind(
        self, index: int, state: dict[Any, Any], keys: tuple[str, ...], with_grad: list[int]
    ) -> list[bool]:
        """Give parameters that get their first update flat state (zeros); returns ``fresh``."""
        bucket, bound = self.buckets[index], self._bound[index]
        if self._keys[index] != keys:  # new hyper-parameters (e.g. amsgrad switched on)
            for k, p in enumerate(bucket.params):
                if bound[k]:
                    self._adopt(bucket, k, state[p], keys)
            self._keys[index] = keys
        fresh = [not bound[k] for k in with_grad]
        if any(fresh):
            for k, new in zip(with_grad, fresh):
                if new:
                    entry = dict.get(state, bucket.params[k])
                    if entry is None:  # created quietly: this is no write to notice
                        entry = ParamState(self.notify)
                        dict.__setitem__(state, bucket.params[k], entry)
                    for key in keys:
                        bucket.state(key)[1][k].zero_()
                        dict.__setitem__(entry, key, bucket.shown(key)[k])
                    if self.rule.counts_steps:
                        view = bucket.steps()[1][k]
                        view.zero_()
                        dict.__setitem__(entry, "step", view)
                    bound[k] = True
            self._counts[index].uniform = None
        return fresh

    def prefill(self, state: dict[Any, Any], groups: list[dict[str, Any]]) -> None:
        """Give every parameter of a sharded bucket its state now, zeros, still fresh.

        ``torch.distributed.checkpoint`` calls ``step()`` on an optimizer whose ``state`` is
        empty, to create the state it saves or loads into; here that step would launch a
        gossip round. The entries made here hold zeros (what the first update starts from) and
        are not *bound*, so the first update still treats them as new.
        """
        for bucket in self.buckets:
            if bucket.mirror is None:
                continue
            keys = self.rule.keys(groups[bucket.group_index])
            for k, p in enumerate(bucket.params):
                entry = ParamState(self.notify)
                for key in keys:
                    dict.__setitem__(entry, key, bucket.shown(key)[k])
                if self.rule.counts_steps:
                    dict.__setitem__(entry, "step", bucket.steps()[1][k])
                dict.__setitem__(state, p, entry)
                self.stale = False  # nothing was written: the entries point at the buffers

    # -- batches --------------------------------------------------------------------------------
    def batch(
        self,
        index: int,
        state: dict[Any, Any],
        group: dict[str, Any],
        grads: list[Tensor | None],
        mix: PendingMix,
        idle_buffer: Callable[[int, Tensor], Tensor | None],
        *,
        traced: bool = False,
    ) -> tuple[Batch | None, PendingMix]:
        """This step's batch of bucket ``index`` and what is left of its mix.

        A batch covers the whole bucket when every parameter has a gradient and the rule is not
        being traced (``traced``: ``torch.compile``); then the mix stays pending for the rule. Otherwise the mix is applied here and
        the batch holds the parameters that have gradients (None if there are none).
        """
        bucket = self.buckets[index]
        with_grad = [k for k, g in enumerate(grads) if g is not None]
        if not with_grad:
            mix.apply_(bucket.data)
            return None, NO_MIX
        keys = self.rule.keys(group)
        fresh = self._bind(index, state, keys, with_grad)
        counted = self.rule.counts_steps
        counters, step_views = bucket.steps() if counted else (None, [])
        if len(with_grad) < len(bucket.params) or traced:
            mix.apply_(bucket.data)
            views = {key: bucket.state(key)[1] for key in keys}
            return Batch(
                bucket=bucket,
                params=[bucket.targets[k] for k in with_grad],
                grads=[_laid_out_like(grads[k], bucket.targets[k]) for k in with_grad],  # type: ignore[arg-type]
                state={key: [v[k] for k in with_grad] for key, v in views.items()},
                steps=[step_views[k] for k in with_grad] if counted else [],
                counters=None,
                step=None,
                fresh=fresh,
                whole=False,
                flat=False,
            ), NO_MIX
        counts = self._counts[index]
        if counted and counts.uniform is None:
            values = counters.tolist()  # type: ignore[union-attr]
            counts.uniform = all(v == values[0] for v in values)
            counts.step = int(values[0]) if counts.uniform else None
        # one kernel call on the flat bucket needs one step count and one first-step flag
        flat = (
            (not counted or bool(counts.uniform))
            and (all(fresh) or not any(fresh))
            and self.rule.flatten(bucket, group)
        )
        present: list[Tensor] = grads  # type: ignore[assignment]
        if flat:
            mix = mix.sum_into_(bucket.data)  # the receive buffer may now serve as scratch
            return Batch(
                bucket=bucket,
                params=[bucket.data],
                grads=[self._flat_grads(index, bucket, present, idle_buffer)],
                state={key: [bucket.state(key)[0]] for key in keys},
                steps=step_views[:1],
                counters=counters,
                step=counts.step if counted else None,
                fresh=fresh[:1],
                whole=True,
                flat=True,
            ), mix
        return Batch(
            bucket=bucket,
            params=list(bucket.targets),
            grads=[_laid_out_like(g, p) for g, p in zip(present, bucket.targets)],
            state={key: list(bucket.state(key)[1]) for key in keys},
            steps=list(step_views),
            counters=counters,
            step=counts.step if counted and counts.uniform else None,
            fresh=fresh,
            whole=True,
            flat=False,
        ), mix

    def updated(self, index: int, batch: Batch, amp_active: bool) -> None:
        """Keep track of the counters after ``batch`` was stepped."""
        counts = self._counts[index]
        if not batch.whole:
            counts.uniform, counts.step = None, None
        elif counts.step is not None:
            counts.step = None if amp_active else counts.step + 1

    def _flat_grads(
        self,
        index: int,
        bucket: Bucket,
        grads: list[Tensor],
        idle_buffer: Callable[[int, Tensor], Tensor | None],
    ) -> Tensor:
        """The gradients copied into one buffer laid out like the bucket.

        The gossip's idle receive buffer of the bucket when it lends one (between mixing and the
        next round it holds nothing anyone needs), so the copy costs no memory; else our own.
        Every-step gossip lends none only at the first step (no round has allocated its buffers
        yet): our own buffer is then freed once the gossip lends one. Where the gossip seldom
        lends (local steps: a round travels through most steps) it is kept, not re-allocated.
        """
        buf = idle_buffer(index, bucket.data)
        if buf is None:
            buf = self._scratch.get(index)
            if buf is None:
                buf = self._scratch[index] = torch.empty_like(bucket.data)
            self._scratch_uses[index] = self._scratch_uses.get(index, 0) + 1
        elif self._scratch_uses.get(index) == 1:  # used once (the first step): free it
            self._scratch.pop(index, None)  # (needed again later, it is re-made and then kept)
        cached = self._grad_views.get(index)
        if cached is None or cached[0] is not buf:
            cached = self._grad_views[index] = (buf, bucket.views(buf))
        torch._foreach_copy_(cached[1], grads)
        return buf


def _step_count(value: Any, p: Tensor) -> float:
    """A loaded or hand-set ``step`` as the number of steps it counts; raises if it is not one."""
    if isinstance(value, Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        count = float(value)
        if math.isfinite(count) and count >= 0 and count == int(count):
            return count
    raise ValueError(
        f"optimizer state 'step' of a parameter of shape {tuple(p.shape)} must count steps "
        f"(a whole number >= 0, as a number or a one-element tensor), got {value!r}"
    )


def _laid_out_like(grad: Tensor, param: Tensor) -> Tensor:
    """``grad``, copied into ``param``'s strides if its own differ.

    torch's fused kernels walk a parameter and its gradient in memory order, element by element
    (on CPUs and GPUs alike), so a channels_last gradient of a contiguous parameter, or a
    transposed view, would be applied to the wrong elements. Gradients that autograd
    accumulates usually have their parameter's strides (not always: pytorch/pytorch#106951)
    and then pass through untouched.
    """
    if grad.stride() == param.stride():
        return grad
    return torch.empty_like(param, memory_format=torch.preserve_format).copy_(grad)

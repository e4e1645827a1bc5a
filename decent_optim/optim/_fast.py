"""What the optimizers' fast update path caches per bucket, so that a step after the first does
no per-parameter Python work: the bucket's state as flat buffers (or as cached per-parameter
lists), one shared step counter, and a scratch buffer for the gradients.

Used by :meth:`DecentralizedOptimizer._update_bucket_fast` of each subclass; the cache lives in
the optimizer and is dropped whenever a bucket takes the general path or state is loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from decent_optim._kernels import folded_decay
from decent_optim.flat import Bucket
from decent_optim.gossip import Gossiper, LocalGossiper

if TYPE_CHECKING:
    from decent_optim.optim._base import DecentralizedOptimizer

__all__ = ["FLATTEN_BELOW_NUMEL", "FastBucket", "can_fold"]

#: On CPUs, torch's fused optimizer kernels cost tens of microseconds per tensor on top of the
#: memory traffic; below this mean tensor size (elements) copying the gradients into one flat
#: buffer and running the kernel once on the whole bucket is faster. GPUs batch tensors in one
#: launch, so there the kernels always run on the per-parameter lists.
FLATTEN_BELOW_NUMEL = 1 << 16


def can_fold(lr: Any) -> bool:
    """True when ``lr`` allows folding a pending mix factor into the decay (a positive number).

    A tensor learning rate would need a device-to-host read per step to compute the folded
    decay, and ``lr == 0`` has no decay to fold into; both take the explicit multiplication.
    """
    return isinstance(lr, (float, int)) and not isinstance(lr, bool) and lr > 0


class FastBucket:
    """The lists one update of a bucket needs, built once from the optimizer's state.

    Attributes:
        key: the state keys it was built for (a changed ``amsgrad`` or ``momentum`` changes
            them, and the cache is rebuilt).
        index, bucket: the bucket and its index among the optimizer's buckets.
        flat: True when the kernels run on the flat buffers (``params == [bucket.data]``, and
            the gradients are copied into :meth:`scratch` by :meth:`grads`).
        params: ``[bucket.data]`` or the bucket's parameters.
        state: per state key, ``[flat buffer]`` or the per-parameter views, like ``params``.
        flat_state: per state key, the flat buffer.
        step_counts: when built with ``counted``: every parameter's ``state["step"]``, stacked
            into one tensor whose entries the state dicts now hold, so one addition advances
            them all; the parameters must all be at the same step.
        step: the common step count (a Python int kept beside ``step_counts``).
    """

    key: tuple[str, ...]
    index: int
    bucket: Bucket
    flat: bool
    params: list[Tensor]
    state: dict[str, list[Tensor]]
    flat_state: dict[str, Tensor]
    step_counts: Tensor
    step: int
    extra: Any  # a subclass's own cached layout (AccumAdam's pieces)

    def __init__(self) -> None:
        self._own: Tensor | None = None
        self._grad_of: Tensor | None = None  # the scratch buffer `_grad_views` view
        self._grad_views: list[Tensor] = []
        self.extra = None

    @classmethod
    def build(
        cls,
        opt: DecentralizedOptimizer,
        index: int,
        bucket: Bucket,
        group: dict[str, Any],
        *,
        counted: bool,
        step_device: torch.device | None,
        flatten: bool,
    ) -> FastBucket | None:
        """The cached lists for bucket ``index``, or None when its state is not ready.

        Not ready: some parameter has no state yet (before its first step) or state outside
        the flat buffers, or (``counted``) step counters that differ or do not live on
        ``step_device`` (default: the bucket's device).
        """
        keys = opt._flat_state_keys(group)
        self = cls()
        self.key, self.index, self.bucket = keys, index, bucket
        if keys or counted:
            states: list[dict[str, Any]] = [opt.state.get(p) or {} for p in bucket.params]
            if any(not st for st in states):
                return None
            views = {key: opt._flat_views(index, bucket, key) for key in keys}
            if any(st.get(k) is not v for k in keys for st, v in zip(states, views[k])):
                return None
            if counted:
                device = bucket.device if step_device is None else step_device
                found = [st.get("step") for st in states]
                if not all(isinstance(s, Tensor) and s.device == device for s in found):
                    return None
                steps = cast(list[Tensor], found)
                counts = torch.stack([s.detach().reshape(()).to(torch.float32) for s in steps])
                if not bool((counts == counts[0]).all()):
                    return None
                self.step_counts, self.step = counts, int(counts[0])
                for k, st in enumerate(states):
                    st["step"] = counts[k]
        self.flat_state = {key: opt._flat_buffer(index, bucket, key)[0] for key in keys}
        n = len(bucket.params)
        self.flat = (
            flatten and bucket.device.type == "cpu" and bucket.numel < FLATTEN_BELOW_NUMEL * n
        )
        if self.flat:
            self.params = [bucket.data]
            self.state = {key: [flat] for key, flat in self.flat_state.items()}
        else:
            self.params = list(bucket.params)
            self.state = {key: opt._flat_views(index, bucket, key) for key in keys}
        return self

    def take_factor(
        self, factor: float, lr: Any, weight_decay: float, *, foldable: bool
    ) -> tuple[float, bool]:
        """Apply the mix's pending ``factor`` to the bucket; returns ``(decay, folded)``.

        Folded (``foldable``, the kernel starts with ``p <- (1 - lr * decay) p``, and ``lr`` a
        positive number): ``decay`` makes the kernel apply the factor in its own pass (see
        :func:`~decent_optim._kernels.folded_decay`). Otherwise the bucket is multiplied now
        and ``decay`` is ``weight_decay``.
        """
        if factor == 1.0:
            return weight_decay, False
        if foldable and can_fold(lr):
            return folded_decay(factor, lr, weight_decay), True
        self.bucket.data.mul_(factor)
        return weight_decay, False

    def scratch(self, gossip: Gossiper | LocalGossiper) -> Tensor:
        """A bucket-sized buffer free until the next gossip round starts.

        The gossip's idle receive buffer of this bucket when there is one (between mixing and
        the next launch it holds nothing anyone needs), so the scratch costs no memory;
        otherwise (one worker) a buffer of our own, allocated once.
        """
        buf = gossip.idle_buffer(self.index, self.bucket.data)
        if buf is not None:
            self._own = None
            return buf
        if self._own is None:
            self._own = torch.empty_like(self.bucket.data)
        return self._own

    def grads(self, gossip: Gossiper | LocalGossiper, grads: list[Tensor]) -> list[Tensor]:
        """The gradients as the kernel takes them: ``grads``, or one flat copy in :meth:`scratch`."""
        if not self.flat:
            return grads
        buf = self.scratch(gossip)
        if buf is not self._grad_of:
            self._grad_of, self._grad_views = buf, self.bucket.views(buf)
        torch._foreach_copy_(self._grad_views, grads)
        return [buf]

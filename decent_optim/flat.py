"""Flat storage: parameters and their optimizer state as contiguous buckets of per-parameter views.

Gossip sends and mixes whole buckets (one message and one kernel per bucket instead of one per
parameter), so the parameters themselves are made views of the buckets: after
:class:`FlatParams` is built, ``p.data`` of every parameter aliases a slice of its bucket and
writing either writes both. The ``Parameter`` objects stay the same, so the model, autograd and
anything holding references keep working.

A bucket also owns the optimizer's per-parameter state: every state tensor (``exp_avg``,
``momentum_buffer``, ...) is a flat buffer laid out like the parameters, and the step counters
are one float32 vector with an element per parameter. ``opt.state[p]`` holds views into them,
so one kernel call updates a whole bucket's parameters and state at once, while the state still
looks to torch tools exactly like torch.optim's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

__all__ = ["Bucket", "FlatParams", "check_flattenable"]


class Bucket:
    """One contiguous buffer holding several parameters of one device, dtype and param group."""

    def __init__(self, params: Sequence[Tensor], group_index: int) -> None:
        self.params = list(params)
        self.group_index = group_index
        first = self.params[0]
        self.device, self.dtype = first.device, first.dtype
        self.offsets: list[int] = []
        total = 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        self.data = torch.empty(total, dtype=self.dtype, device=self.device)
        for p, offset in zip(self.params, self.offsets):
            view = self.view_of(self.data, p, offset)
            view.copy_(p.detach())
            p.data = view
        self._ptrs = [p.data_ptr() for p in self.params]
        self._state: dict[str, tuple[Tensor, list[Tensor]]] = {}

    @staticmethod
    def view_of(flat: Tensor, like: Tensor, offset: int) -> Tensor:
        """The slice of ``flat`` at ``offset`` with ``like``'s shape and strides (memory format kept)."""
        return flat.as_strided(like.size(), like.stride(), flat.storage_offset() + offset)

    def views(self, flat: Tensor) -> list[Tensor]:
        """Per-parameter views into ``flat``, a buffer laid out like :attr:`data`."""
        return [self.view_of(flat, p, off) for p, off in zip(self.params, self.offsets)]

    def segments(self, flat: Tensor) -> list[Tensor]:
        """Per-parameter one-dimensional slices of ``flat``, in memory order."""
        return [flat[off : off + p.numel()] for p, off in zip(self.params, self.offsets)]

    def state(self, key: str) -> tuple[Tensor, list[Tensor]]:
        """State buffer ``key``: one flat tensor like :attr:`data` (zeros at first), and its views."""
        entry = self._state.get(key)
        if entry is None:
            flat = torch.zeros_like(self.data)
            entry = self._state[key] = (flat, self.views(flat))
        return entry

    def steps(self) -> tuple[Tensor, list[Tensor]]:
        """The step counters: a float32 vector with one element per parameter, and its 0-d views.

        float32 on the parameters' device is the layout torch's fused kernels read.
        """
        entry = self._state.get("step")
        if entry is None:
            flat = torch.zeros(len(self.params), dtype=torch.float32, device=self.device)
            entry = self._state["step"] = (flat, list(flat.unbind()))
        return entry

    def check_aliasing(self) -> None:
        """Raise if some parameter stopped viewing this bucket (then gossip would miss it)."""
        if [p.data_ptr() for p in self.params] == self._ptrs:
            return  # every step: one comparison of lists, not a Python loop
        for p, ptr in zip(self.params, self._ptrs):
            if p.data_ptr() != ptr:
                raise RuntimeError(
                    f"a parameter of shape {tuple(p.shape)} no longer views the optimizer's flat "
                    "buffer (was `p.data` reassigned, or the model moved with .to() after the "
                    "optimizer was built?); build the optimizer after moving the model and copy "
                    "new values in place with `p.copy_(...)`"
                )


class FlatParams:
    """Buckets of about ``bucket_cap_mb`` megabytes; every parameter becomes a view of one.

    A bucket never mixes devices, dtypes (nothing is cast) or parameter groups (the local update
    of a bucket uses one set of hyper-parameters). A parameter larger than the cap gets a bucket
    of its own. Parameters must be dense and non-overlapping (contiguous or another dense memory
    format such as ``channels_last``, which is kept).

    Args:
        groups: the parameters of each param group, in order.
        bucket_cap_mb: target bucket size in megabytes (2**20 bytes).
    """

    def __init__(self, groups: Iterable[Sequence[Tensor]], bucket_cap_mb: float) -> None:
        cap = int(bucket_cap_mb * 2**20)
        self.buckets: list[Bucket] = []
        for gi, params in enumerate(groups):
            open_: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], int]] = {}
            for p in params:
                key = (p.device, p.dtype)
                members, size = open_.get(key, ([], 0))
                nbytes = p.numel() * p.element_size()
                if members and size + nbytes > cap:
                    self.buckets.append(Bucket(members, gi))
                    members, size = [], 0
                open_[key] = (members + [p], size + nbytes)
            self.buckets += [Bucket(members, gi) for members, _ in open_.values() if members]

    @property
    def buffers(self) -> list[Tensor]:
        return [b.data for b in self.buckets]

    def check_aliasing(self) -> None:
        """Raise if some parameter stopped viewing its bucket (then gossip would miss it)."""
        for b in self.buckets:
            b.check_aliasing()


def check_flattenable(p: Tensor) -> None:
    """Raise TypeError/ValueError for parameters that cannot live in a flat bucket."""
    if p.is_sparse or p.layout != torch.strided:
        raise TypeError(f"parameters must be dense strided tensors, got layout {p.layout}")
    if p.is_complex():
        raise TypeError(
            "complex parameters are not supported; register torch.view_as_real(p) as a real "
            "parameter instead"
        )
    if not p.is_floating_point():
        raise TypeError(f"parameters must be floating point, got {p.dtype}")
    if not _is_dense(p):
        raise ValueError(
            f"a parameter of shape {tuple(p.shape)} with strides {p.stride()} overlaps itself or "
            "has gaps; call .contiguous() on it before building the optimizer"
        )


def _is_dense(p: Tensor) -> bool:
    """True when the strides cover exactly numel elements with no overlap (any dim order)."""
    if p.is_contiguous():
        return True
    dims = sorted((s, n) for s, n in zip(p.stride(), p.size()) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True

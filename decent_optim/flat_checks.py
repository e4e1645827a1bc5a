"""What may live in a flat bucket: the checks start-up runs on the parameters before building one.

A bucket (:mod:`decent_optim.flat`) holds dense, strided, real floating-point parameters, each in
a stretch of its own. :func:`check_flattenable` refuses a parameter that cannot be laid out that
way; :func:`check_disjoint` refuses two parameters over one memory, which the buckets would untie.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from decent_optim import sharded

__all__ = ["check_disjoint", "check_flattenable"]


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


def check_disjoint(params: Sequence[Tensor], names: Sequence[str | None] = ()) -> None:
    """Raise ValueError when two parameters share memory: the buckets would untie them.

    torch.optim updates shared memory through each parameter in turn; here every parameter gets
    a stretch of a bucket of its own, so two parameters over one memory would silently become
    two independent copies. Weights are tied by using one ``Parameter`` in both places, which
    the buckets keep. ``names`` label the parameters in the message (else position and shape).
    """
    spans = sorted(
        (str(p.device), p.data_ptr(), p.data_ptr() + int(p.numel()) * p.element_size(), k)
        for k, p in enumerate(map(sharded.local, params))
        if p.numel() and p.data_ptr()  # (meta tensors have no memory: address 0)
    )
    reach: tuple[str, int, int] = ("", 0, -1)  # device, end and index of the span reaching furthest
    for device, start, end, k in spans:
        if device == reach[0] and start < reach[1]:
            first, second = sorted((reach[2], k))
            raise ValueError(
                f"parameters {_label(params, names, first)} and {_label(params, names, second)} "
                "share memory (one parameter given twice, or tied weights made as two Parameter "
                "objects over one tensor): the optimizer gives each parameter its own place in a "
                "flat buffer, which would untie them. Pass each parameter once, tie weights by "
                "sharing one Parameter (`head.weight = embedding.weight`), or give each its own "
                "memory with `nn.Parameter(t.clone())`"
            )
        if device != reach[0] or end > reach[1]:
            reach = (device, end, k)


def _label(params: Sequence[Tensor], names: Sequence[str | None], k: int) -> str:
    name = names[k] if k < len(names) else None
    return f"{k} ({name!r})" if name else f"{k} (shape {tuple(params[k].shape)})"

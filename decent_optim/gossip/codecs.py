r"""Codecs for compressed gossip: what crosses the wire instead of a float difference.

A codec turns a difference :math:`d = a - b` of two float buffers into a byte payload, and a
payload back into values added to a buffer. Decoding is a pure function of the payload, computed
by the same operations on every rank, so all holders of a public copy that add the same payload
keep bit-identical copies (see :mod:`decent_optim.gossip.compressed`).

* ``"bf16"``: :math:`d` rounded to bfloat16 (round to nearest even): 2 bytes per element, error at
  most :math:`2^{-8} |d_k|` per element.
* ``"int8"``: :math:`d` cut into chunks of :data:`CHUNK` elements; chunk :math:`c` is sent as
  :math:`q = \mathrm{round}(d / s_c)` in int8 with the scale :math:`s_c = \max_{k \in c} |d_k| / 127`
  as float32: 1 byte per element plus 4 per chunk (0.4% more), error at most :math:`s_c / 2` per
  element, and an error of the chunk's 2-norm at most :math:`\sqrt{C/4}\, s_c \le
  \lVert d_c \rVert_2 \sqrt{C} / 254` (12.6% of it for :data:`CHUNK` = 1024; typically far less).

Both work a slice of the buffers at a time (:data:`SLICE` elements), so that the float
temporaries stay in cache and a pass costs only its reads and writes of the buffers.

The sparse and low-bit codecs are in :mod:`decent_optim.gossip.sparse_codecs`; :func:`get` makes
any codec from its name: ``"int4"`` and ``"int2"`` are ``Quantized(4)`` and ``Quantized(2)``,
``"rand<p>%"`` is ``RandomK(p)``, ``"top<p>%"`` is ``TopK(p)``, and ``"+int8"``, ``"+int4"``,
``"+int2"`` after either is ``bits=8, 4, 2`` (``"top1%+int2"`` is ``TopK(1, bits=2)``). A codec
object passes through :func:`get` unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from decent_optim.gossip.codec_base import CHUNK, SLICE, Codec, divide_, slice_len
from decent_optim.gossip.sparse_codecs import Chunked, Quantized, RandomK, TopK  # noqa: F401
from decent_optim.runtime import wire

__all__ = [
    "CHUNK",
    "CODECS",
    "SLICE",
    "slice_len",
    "Bf16",
    "Chunked",
    "Codec",
    "Int8",
    "Quantized",
    "RandomK",
    "TopK",
    "get",
]


class Bf16(Codec):
    """bfloat16 rounding of the difference."""

    name = "bf16"
    bytes_per_element = 2.0

    def nbytes(self, numel: int) -> int:
        return 2 * numel

    def encode_(
        self,
        a: Tensor,
        b: Tensor,
        payload: Tensor,
        *,
        absorb: bool = False,
        seed: int | None = None,
    ) -> None:
        values = payload.view(torch.bfloat16)
        step = slice_len(a.device)
        for lo in range(0, a.numel(), step):
            hi = min(lo + step, a.numel())
            # computed in a's precision, rounded once when written to the bfloat16 output
            torch.sub(a[lo:hi], b[lo:hi], out=values[lo:hi])
            if absorb:
                self.decode_add_(payload, b, lo, hi)

    def decode_add_(self, payload: Tensor, out: Tensor, lo: int = 0, hi: int | None = None) -> None:
        hi = out.numel() if hi is None else hi
        out[lo:hi].add_(payload.view(torch.bfloat16)[lo:hi])

    def nonfinite(self, payload: Tensor) -> Tensor:
        # inf and NaN are the bfloat16 values whose 8 exponent bits are all ones; testing the
        # bits as integers is much faster on CPUs than isfinite on bfloat16 (6.3M values, 2
        # threads, best of 15: 0.78 ms against 10.5 ms; the encode itself: 2.75 ms)
        if payload.numel() == 0:
            return torch.zeros((), dtype=torch.bool, device=payload.device)
        exponent = payload.view(torch.int16) & 0x7F80
        return exponent.max() == 0x7F80


class Int8(Codec):
    """Per-chunk absolute-maximum scaling to int8; the payload is ``[int8 values | float32 scales]``."""

    name = "int8"
    bytes_per_element = 1.0 + 4.0 / CHUNK

    def __init__(self) -> None:
        self._scratch: dict[tuple[torch.device, torch.dtype], Tensor] = {}

    def nbytes(self, numel: int) -> int:
        chunks = -(-numel // CHUNK)
        return chunks * CHUNK + 4 * chunks

    def parts(self, payload: Tensor) -> tuple[Tensor, Tensor]:
        """The int8 values (padded to whole chunks) and the float32 scales of ``payload``."""
        chunks = payload.numel() // (CHUNK + 4)
        return payload[: chunks * CHUNK].view(torch.int8), payload[chunks * CHUNK :].view(
            torch.float32
        )

    def encode_(
        self,
        a: Tensor,
        b: Tensor,
        payload: Tensor,
        *,
        absorb: bool = False,
        seed: int | None = None,
    ) -> None:
        values, scales = self.parts(payload)
        n = a.numel()
        tmp = self._tmp(a)
        step = slice_len(a.device)
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            width = -(-(hi - lo) // CHUNK) * CHUNK
            d = tmp[:width]
            torch.sub(a[lo:hi], b[lo:hi], out=d[: hi - lo])
            d[hi - lo :].zero_()  # the tail of the last chunk: zeros change no maximum
            rows = d.view(-1, CHUNK)
            # amax and amin: on CPUs several times faster than aminmax or a norm along dim 1
            high, low = rows.amax(1), rows.amin(1)
            scale = scales[lo // CHUNK : lo // CHUNK + rows.shape[0]]
            torch.maximum(high, low.neg_(), out=high)
            scale.copy_(divide_(high, 127))
            # divide by the scale as stored (float32), so that |q| <= 127 up to its rounding
            inv = torch.reciprocal(scale.to(d.dtype)).nan_to_num_(posinf=0.0)
            rows.mul_(inv.unsqueeze(1)).round_().clamp_(-127, 127)
            values[lo : lo + width].copy_(d)
            if absorb:  # d holds the int8 values exactly: the product decode_add_ forms
                rows.mul_(scale.to(d.dtype).unsqueeze(1))
                b[lo:hi].add_(d[: hi - lo])

    def decode_add_(self, payload: Tensor, out: Tensor, lo: int = 0, hi: int | None = None) -> None:
        values, scales = self.parts(payload)
        hi = out.numel() if hi is None else hi
        tmp = self._tmp(out)
        step = slice_len(out.device)
        for start in range(lo, hi, step):
            stop = min(start + step, hi)
            width = -(-(stop - start) // CHUNK) * CHUNK
            d = tmp[:width]
            chunks = scales[start // CHUNK : start // CHUNK + width // CHUNK]
            # int8 to float is exact, then one correctly rounded product and one sum: the same
            # bits on any hardware (a fused multiply-add could differ between machines)
            torch.mul(
                values[start : start + width].view(-1, CHUNK),
                chunks.to(d.dtype).unsqueeze(1),
                out=d.view(-1, CHUNK),
            )
            out[start:stop].add_(d[: stop - start])

    def nonfinite(self, payload: Tensor) -> Tensor:
        # a non-finite difference makes its chunk's scale (its largest magnitude) inf or NaN,
        # so the scales alone tell: 1/1024 of the payload
        return ~torch.isfinite(self.parts(payload)[1]).all()

    def _tmp(self, like: Tensor) -> Tensor:
        dtype = torch.promote_types(like.dtype, torch.float32)
        key = (like.device, dtype)
        # a slice, or less for a smaller buffer (a GPU's slices are 64 MB)
        need = min(slice_len(like.device), -(-like.numel() // CHUNK) * CHUNK)
        tmp = self._scratch.get(key)
        if tmp is None or tmp.numel() < need:
            tmp = self._scratch[key] = torch.empty(need, dtype=dtype, device=like.device)
        return tmp


#: the codecs of a fixed name (more by pattern: :mod:`decent_optim.runtime.wire`)
CODECS: dict[str, Callable[[], Codec]] = {
    "bf16": Bf16,
    "int8": Int8,
    "int4": lambda: Quantized(4),
    "int2": lambda: Quantized(2),
}


def get(name: str | Codec) -> Codec:
    """A new codec by name (:func:`decent_optim.runtime.wire.names_help` lists the grammar), or
    ``name`` itself if it is a :class:`Codec`; TypeError or ValueError for anything else."""
    if isinstance(name, Codec):
        return name
    if isinstance(name, bool) or not isinstance(name, str):
        raise TypeError(
            f"compression must be None or one of {wire.names_help()} (or a "
            f"decent_optim.gossip.codecs.Codec), got {type(name).__name__}"
        )
    make = CODECS.get(name)
    if make is not None:
        return make()
    try:
        spec = wire.parse(name)
    except ValueError as err:
        raise ValueError(f"{err}; None sends the parameters uncompressed") from None
    assert spec is not None and spec.keep != "all"  # the fixed names are in CODECS
    bits = None if spec.bits == 32 else spec.bits
    return (RandomK if spec.keep == "rand" else TopK)(spec.percent, bits)

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
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor

__all__ = ["CHUNK", "CODECS", "SLICE", "Bf16", "Codec", "Int8", "get"]

#: elements per int8 chunk (one float32 scale each)
CHUNK = 1024
#: elements per slice of a pass (a multiple of CHUNK): float32 temporaries of 1 MB stay in cache,
#: and a slice is long enough that the per-operation overhead is small (measured on a 2-core
#: CPU, 6.3M elements: 2**15: 29 ms to encode, 2**17: 9.1 ms, 2**18: 7.7 ms, 2**19: 7.0 ms)
SLICE = 1 << 18


class Codec(ABC):
    """Encodes :math:`a - b` into a ``uint8`` payload; decodes a payload into ``out += values``."""

    #: the name ``compression=`` takes
    name: str
    #: bytes on the wire per element, for the runtime model (scales included)
    bytes_per_element: float

    @abstractmethod
    def nbytes(self, numel: int) -> int:
        """Size in bytes of the payload of ``numel`` elements."""

    @abstractmethod
    def encode_(self, a: Tensor, b: Tensor, payload: Tensor, *, absorb: bool = False) -> None:
        """``payload <- Q(a - b)``; ``a`` and ``b`` are one-dimensional and alike.

        With ``absorb``, also ``b += decode(payload)`` in the same pass over memory, with the
        same operations :meth:`decode_add_` uses (so the same bits).
        """

    @abstractmethod
    def decode_add_(self, payload: Tensor, out: Tensor, lo: int = 0, hi: int | None = None) -> None:
        """``out[lo:hi] += decode(payload)[lo:hi]``; ``lo`` a multiple of :data:`CHUNK`."""

    @abstractmethod
    def nonfinite(self, payload: Tensor) -> Tensor:
        """A 0-d bool tensor: whether ``payload`` decodes to some inf or NaN (no host read)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Bf16(Codec):
    """bfloat16 rounding of the difference."""

    name = "bf16"
    bytes_per_element = 2.0

    def nbytes(self, numel: int) -> int:
        return 2 * numel

    def encode_(self, a: Tensor, b: Tensor, payload: Tensor, *, absorb: bool = False) -> None:
        values = payload.view(torch.bfloat16)
        for lo in range(0, a.numel(), SLICE):
            hi = min(lo + SLICE, a.numel())
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

    def encode_(self, a: Tensor, b: Tensor, payload: Tensor, *, absorb: bool = False) -> None:
        values, scales = self.parts(payload)
        n = a.numel()
        tmp = self._tmp(a)
        for lo in range(0, n, SLICE):
            hi = min(lo + SLICE, n)
            width = -(-(hi - lo) // CHUNK) * CHUNK
            d = tmp[:width]
            torch.sub(a[lo:hi], b[lo:hi], out=d[: hi - lo])
            d[hi - lo :].zero_()  # the tail of the last chunk: zeros change no maximum
            rows = d.view(-1, CHUNK)
            # amax and amin: on CPUs several times faster than aminmax or a norm along dim 1
            high, low = rows.amax(1), rows.amin(1)
            scale = scales[lo // CHUNK : lo // CHUNK + rows.shape[0]]
            torch.maximum(high, low.neg_(), out=high)
            scale.copy_(high.div_(127))
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
        for start in range(lo, hi, SLICE):
            stop = min(start + SLICE, hi)
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
        tmp = self._scratch.get(key)
        if tmp is None:
            tmp = self._scratch[key] = torch.empty(SLICE, dtype=dtype, device=like.device)
        return tmp


#: the codecs by the name ``compression=`` takes
CODECS: dict[str, type[Codec]] = {"bf16": Bf16, "int8": Int8}


def get(name: str) -> Codec:
    """A new codec by name; raises ValueError for an unknown one."""
    if isinstance(name, bool) or not isinstance(name, str):
        raise TypeError(
            f"compression must be None or one of {sorted(CODECS)}, got {type(name).__name__}"
        )
    cls = CODECS.get(name)
    if cls is None:
        raise ValueError(
            f"compression must be None or one of {sorted(CODECS)}, got {name!r}; "
            "None sends the parameters uncompressed"
        )
    return cls()

"""The interface of a gossip codec (:mod:`decent_optim.gossip.codecs` has the codecs and
:func:`~decent_optim.gossip.codecs.get`), apart so that every codec module can implement it."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from decent_optim.runtime.wire import CHUNK

__all__ = ["CHUNK", "SLICE", "Codec", "slice_len"]

#: elements per slice of a pass (a multiple of CHUNK): float32 temporaries of 1 MB stay in cache,
#: and a slice is long enough that the per-operation overhead is small (measured on a 2-core
#: CPU, 6.3M elements: 2**15: 29 ms to encode, 2**17: 9.1 ms, 2**18: 7.7 ms, 2**19: 7.0 ms)
SLICE = 1 << 18
#: the same per device kind: a GPU launches about ten kernels per slice, each of several
#: microseconds, so its slices are far larger. Measured on an H200 (benchmarks/codec_speed.py,
#: 124M elements, encode with absorb): int8 64 ms at 2**18, 4.6 ms at 2**22, 3.0 ms at 2**24;
#: top1%+int2 269, 21 and 6.1 ms (a 163M-parameter GPT's training step: 32-55 ms there).
SLICE_BY_DEVICE = {"cpu": SLICE, "cuda": 1 << 24}


def divide_(x: Tensor, divisor: float) -> Tensor:
    """``x /= divisor`` in place, one correctly rounded quotient per value on every device.

    CUDA turns a division by a host number into a product with its reciprocal, which may round
    the other way: a chunk's scale, and so its payload, would then depend on the hardware.
    """
    return x.div_(torch.full((), divisor, dtype=x.dtype, device=x.device))


def slice_len(device: torch.device) -> int:
    """Elements per slice of a codec's pass over buffers on ``device``."""
    return SLICE_BY_DEVICE.get(device.type, SLICE_BY_DEVICE["cuda"])


class Codec(ABC):
    """Encodes :math:`a - b` into a ``uint8`` payload; decodes a payload into ``out += values``."""

    #: the name ``compression=`` takes
    name: str
    #: bytes on the wire per element, for the runtime model (scales included)
    bytes_per_element: float
    #: the consensus step of the mix, :math:`\gamma` of :mod:`~decent_optim.gossip.compressed`
    #: (below 1 for codecs that leave out most of a difference)
    gamma: float = 1.0
    #: whether the public copies start from the values every rank holds after the start-up
    #: broadcast, so that the first round sends this codec's payload instead of exact values
    #: (bf16 and int8 keep their exact first round, bit for bit as before)
    primes_from_start: bool = False

    @abstractmethod
    def nbytes(self, numel: int) -> int:
        """Size in bytes of the payload of ``numel`` elements."""

    @abstractmethod
    def encode_(
        self,
        a: Tensor,
        b: Tensor,
        payload: Tensor,
        *,
        absorb: bool = False,
        seed: int | None = None,
    ) -> None:
        """``payload <- Q(a - b)``; ``a`` and ``b`` are one-dimensional and alike.

        With ``absorb``, also ``b += decode(payload)`` in the same pass over memory, with the
        same operations :meth:`decode_add_` uses (so the same bits). ``seed``: a number that
        changes every round, for codecs that draw at random (the others ignore it); None: a
        counter of the codec's own.
        """

    @abstractmethod
    def decode_add_(self, payload: Tensor, out: Tensor, lo: int = 0, hi: int | None = None) -> None:
        """``out[lo:hi] += decode(payload)[lo:hi]``; ``lo`` a multiple of :data:`CHUNK`."""

    @abstractmethod
    def nonfinite(self, payload: Tensor) -> Tensor:
        """A 0-d bool tensor: whether ``payload`` decodes to some inf or NaN (no host read)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

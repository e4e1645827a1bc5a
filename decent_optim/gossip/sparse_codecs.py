r"""Sparse and low-bit codecs: a few values of every chunk, in a few bits each.

The difference :math:`d` is cut into chunks of :math:`C` elements (:data:`~.codecs.CHUNK`; the
tail chunk is padded with zeros). Of chunk :math:`c` a codec keeps :math:`k` positions
:math:`S_c` (the sizes of :mod:`decent_optim.runtime.wire`) and sends the values there:

* all :math:`C` (``"int4"``, ``"int2"``, and ``"int8"`` inside a combination);
* ``"rand<p>%"``: :math:`S_c = \{(\pi_j + o_c) \bmod C : j < k\}` with a permutation :math:`\pi` of
  :math:`0..C-1` and offsets :math:`o_c`, drawn by a :class:`torch.Generator` (CPU) from a seed that
  travels in the payload (8 bytes, no positions): every holder draws the same positions, and the
  seed changes every round (:class:`~decent_optim.gossip.compressed.CompressedGroup` derives it
  from the round and the bucket);
* ``"top<p>%"``: the :math:`k` largest :math:`|d_i|` of the chunk, positions sent as uint16.

Values travel as float32, or quantized to :math:`b` bits with a float32 scale per chunk,
:math:`s_c = \max_{i \in S_c} |d_i| / L` and :math:`q_i = \mathrm{round}(d_i / s_c) \in [-L, L]`
(:math:`L` = 127, 7, 1 for 8, 4, 2 bits: symmetric levels, so zero is exact and 2 bits are
ternary, sign or nothing), packed :math:`8/b` to a byte as :math:`q + L`. What is decoded is
:math:`s_c q_i` at :math:`S_c` and zero elsewhere: no :math:`1/p` rescaling, so
:math:`\lVert d - Q(d) \rVert \le \lVert d \rVert` and error feedback contracts (CHOCO).

Strong sparsification needs a consensus step below one: :attr:`Chunked.gamma` (see
``docs/algorithms.rst``, measured by a float64 simulation of the recursion).
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from decent_optim.gossip.codec_base import CHUNK, Codec, divide_, slice_len
from decent_optim.runtime.wire import LEVELS, Spec

__all__ = ["Chunked", "Quantized", "RandomK", "TopK"]

_MASK = (1 << 63) - 1


class Chunked(Codec):
    """A chunked codec of :mod:`decent_optim.runtime.wire`'s grammar (module docstring).

    Payload: ``[seed int64 (rand) | scales float32 (quantized) | values float32 (unquantized) |
    positions uint16 (top) | values packed (quantized)]``, each part aligned to its type.
    """

    #: an exact first round would cost as many bytes as hundreds of these rounds
    primes_from_start = True

    def __init__(self, spec: Spec, chunk: int = CHUNK, gamma: float | None = None) -> None:
        if chunk < 1 or CHUNK % chunk:
            raise ValueError(f"chunk must divide {CHUNK}, got {chunk}")
        if gamma is not None and (
            isinstance(gamma, bool) or not isinstance(gamma, numbers.Real) or not 0 < gamma <= 1
        ):
            raise ValueError(
                f"gamma must be None (the codec's own step) or a number in (0, 1], got {gamma!r}"
            )
        self.spec, self.chunk = spec, chunk
        self.name = spec.name
        self.k = spec.kept(chunk)
        self.bytes_per_element = (
            spec.nbytes(chunk, chunk) - (8 if spec.keep == "rand" else 0)
        ) / chunk
        #: the consensus step of the mix (module docstring of :mod:`.compressed`)
        self.gamma = _gamma(spec, chunk) if gamma is None else float(gamma)
        self._own_gamma = gamma is not None
        self._counter = 0  # seeds of encodes that were given none
        self._drawn: tuple[tuple[int, int, torch.device], Tensor] | None = None

    def __repr__(self) -> str:
        # the step is part of what the ranks must agree on (start-up compares this text)
        gamma = f", gamma={self.gamma!r}" if self._own_gamma else ""
        return f"{type(self).__name__}({self.name!r}{gamma})"

    def nbytes(self, numel: int) -> int:
        return self.spec.nbytes(numel, self.chunk)

    def _parts(self, payload: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor, Tensor | None]:
        """Seed, scales, values and positions of ``payload`` (views)."""
        spec, k = self.spec, self.k
        chunks = self._chunks(payload.numel())
        at = 0
        seed = scales = positions = None
        if spec.keep == "rand":
            seed, at = payload[:8].view(torch.int64), 8
        if spec.bits != 32:
            scales, at = payload[at : at + 4 * chunks].view(torch.float32), at + 4 * chunks
        size = chunks * spec.row_bytes(self.chunk)
        if spec.bits == 32:  # float32 values before the positions, packed bytes after them
            values, at = payload[at : at + size].view(torch.float32), at + size
        if spec.keep == "top":
            positions, at = (
                payload[at : at + 2 * k * chunks].view(torch.uint16),
                at + 2 * k * chunks,
            )
        if spec.bits != 32:
            values = payload[at : at + size]
        row = spec.row_bytes(self.chunk) // (4 if spec.bits == 32 else 1)
        return seed, scales, values.view(chunks, row), positions

    def _chunks(self, nbytes: int) -> int:
        """The number of chunks of a payload of ``nbytes`` (sizes grow by a fixed step per chunk)."""
        fixed = 8 if self.spec.keep == "rand" else 0
        return (nbytes - fixed) // (self.spec.nbytes(self.chunk, self.chunk) - fixed)

    def encode_(
        self,
        a: Tensor,
        b: Tensor,
        payload: Tensor,
        *,
        absorb: bool = False,
        seed: int | None = None,
    ) -> None:
        spec, chunk, k = self.spec, self.chunk, self.k
        seed_part, scales, values, positions = self._parts(payload)
        if seed_part is not None:
            if seed is None:
                seed, self._counter = self._counter, self._counter + 1
            seed_part.fill_(seed & _MASK)
        n = a.numel()
        dtype = torch.promote_types(a.dtype, torch.float32)
        step = slice_len(a.device)
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            c0, width = lo // chunk, -(-(hi - lo) // chunk) * chunk
            d = torch.zeros(width, dtype=dtype, device=a.device)  # a zero tail changes no maximum
            torch.sub(a[lo:hi], b[lo:hi], out=d[: hi - lo])
            rows = d.view(-1, chunk)
            c1 = c0 + rows.shape[0]
            if spec.keep == "all":
                kept = rows
            else:
                if spec.keep == "top":
                    where = rows.abs().topk(k, dim=1, sorted=False).indices
                    assert positions is not None
                    positions.view(-1, k)[c0:c1].copy_(where)
                else:
                    where = self._positions(payload, n, c0, c1)
                kept = rows.gather(1, where)
            if spec.bits == 32:
                values[c0:c1].copy_(kept)
            else:
                assert scales is not None
                level = LEVELS[spec.bits]
                scale = scales[c0:c1]
                scale.copy_(divide_(kept.abs().amax(1), level))
                # divide by the scale as stored (float32), so that |q| <= L up to its rounding
                inv = torch.reciprocal(scale.to(dtype)).nan_to_num_(posinf=0.0)
                q = (kept * inv.unsqueeze(1)).round_().clamp_(-level, level)
                values[c0:c1].copy_(_pack(q.add_(level).to(torch.uint8), spec.bits))
            if absorb:  # the same function of the payload as every other holder computes
                self.decode_add_(payload, b, lo, hi)

    def decode_add_(self, payload: Tensor, out: Tensor, lo: int = 0, hi: int | None = None) -> None:
        spec, chunk, k = self.spec, self.chunk, self.k
        _, scales, values, positions = self._parts(payload)
        hi = out.numel() if hi is None else hi
        if lo % chunk:
            raise ValueError(f"decode_add_: lo must be a multiple of the chunk, {chunk}, got {lo}")
        dtype = torch.promote_types(out.dtype, torch.float32)
        step = slice_len(out.device)
        for start in range(lo, hi, step):
            stop = min(start + step, hi)
            c0 = start // chunk
            c1 = c0 + -(-(stop - start) // chunk)
            if spec.bits == 32:
                kept = values[c0:c1].to(dtype)
            else:
                assert scales is not None
                level = LEVELS[spec.bits]
                q = _unpack(values[c0:c1], spec.bits, k).to(dtype).sub_(level)
                # exact integers times the scale: one correctly rounded product per value
                kept = q.mul_(scales[c0:c1].to(dtype).unsqueeze(1))
            if spec.keep == "all":
                rows = kept
            else:
                if spec.keep == "top":
                    assert positions is not None
                    where = positions.view(-1, k)[c0:c1].to(torch.int64)
                else:
                    where = self._positions(payload, out.numel(), c0, c1)
                rows = kept.new_zeros(c1 - c0, chunk).scatter_(1, where, kept)
            out[start:stop].add_(rows.view(-1)[: stop - start])

    def nonfinite(self, payload: Tensor) -> Tensor:
        _, scales, values, _ = self._parts(payload)
        # a non-finite kept value makes its chunk's scale inf or NaN
        checked = values if scales is None else scales
        return ~torch.isfinite(checked).all()

    def _positions(self, payload: Tensor, numel: int, c0: int, c1: int) -> Tensor:
        """The random positions of chunks ``c0..c1`` of a payload of ``numel`` elements."""
        seed = int(payload[:8].view(torch.int64).item())
        key = (seed, numel, payload.device)
        if self._drawn is None or self._drawn[0] != key:
            gen = torch.Generator().manual_seed(seed)
            chunks = -(-numel // self.chunk)
            perm = torch.randperm(self.chunk, generator=gen)[: self.k]
            offsets = torch.randint(0, self.chunk, (chunks, 1), generator=gen)
            self._drawn = (key, perm.add(offsets).remainder_(self.chunk).to(payload.device))
        return self._drawn[1][c0:c1]


def _pack(u: Tensor, bits: int) -> Tensor:
    """Rows of values below ``2**bits`` packed ``8 // bits`` to a byte (rows padded with zeros)."""
    per = 8 // bits
    if per == 1:
        return u
    rows, k = u.shape
    padded = u.new_zeros(rows, -(-k // per) * per)
    padded[:, :k] = u
    out = padded[:, 0::per].clone()
    for j in range(1, per):
        out |= padded[:, j::per] << (bits * j)
    return out


def _unpack(packed: Tensor, bits: int, k: int) -> Tensor:
    """The first ``k`` values of every row of :func:`_pack`'s output."""
    per = 8 // bits
    if per == 1:
        return packed
    mask = (1 << bits) - 1
    out = packed.new_empty(packed.shape[0], packed.shape[1] * per)
    for j in range(per):
        out[:, j::per] = (packed >> (bits * j)) & mask
    return out[:, :k]


def _gamma(spec: Spec, chunk: int) -> float:
    r"""The consensus step for ``spec``: :math:`\min(c f, g)` with :math:`f = k / C` the share kept,
    :math:`c` = 1/2 for random-k, 2 for top-k (none for every element) and :math:`g` = 0.2 for
    ternary values, 1 otherwise. Chosen from a float64 simulation of the recursion
    (``benchmarks/codec_gamma.py``; the numbers are in ``docs/algorithms.rst``)."""
    share = spec.kept(chunk) / chunk
    most = 0.2 if spec.bits == 2 else 1.0
    if spec.keep == "all":
        return most
    return min(share * (0.5 if spec.keep == "rand" else 2.0), most)


class Quantized(Chunked):
    """Every element, ``bits`` (4 or 2) per value with a float32 scale per chunk: ``"int4"``,
    ``"int2"``."""

    def __init__(self, bits: int, chunk: int = CHUNK, gamma: float | None = None) -> None:
        if bits not in (2, 4):
            raise ValueError(f"Quantized: bits must be 4 or 2 (8 is codecs.Int8), got {bits}")
        super().__init__(Spec("all", 100.0, bits), chunk, gamma)


class _Kept(Chunked):
    """A codec that keeps ``percent`` % of each chunk, chosen as :attr:`keep` says, in ``bits``
    (8, 4, 2) or as float32 values (``bits=None``). ``gamma``: the consensus step, instead of
    the codec's own (:attr:`Chunked.gamma`)."""

    keep: str

    def __init__(
        self,
        percent: float,
        bits: int | None = None,
        chunk: int = CHUNK,
        gamma: float | None = None,
    ) -> None:
        super().__init__(_spec(self.keep, percent, bits), chunk, gamma)


class RandomK(_Kept):
    """``percent`` % of each chunk at random positions from a shared seed: ``"rand<p>%"``, with
    ``bits`` (8, 4, 2) ``"rand<p>%+int<bits>"``; ``bits=None`` sends float32 values. ``gamma``:
    the consensus step, instead of the codec's own (:attr:`Chunked.gamma`)."""

    keep = "rand"


class TopK(_Kept):
    """The ``percent`` % largest magnitudes of each chunk, with their positions: ``"top<p>%"``,
    with ``bits`` (8, 4, 2) ``"top<p>%+int<bits>"``; ``bits=None`` sends float32 values.
    ``gamma``: the consensus step, instead of the codec's own (:attr:`Chunked.gamma`)."""

    keep = "top"


def _spec(keep: str, percent: float, bits: int | None) -> Spec:
    if isinstance(percent, bool) or not isinstance(percent, (int, float)) or not 0 < percent <= 100:
        raise ValueError(f"percent must be a number in (0, 100], got {percent!r}")
    if bits not in (None, 8, 4, 2):
        raise ValueError(f"bits must be None (float32 values), 8, 4 or 2, got {bits!r}")
    return Spec(keep, float(percent), 32 if bits is None else bits)

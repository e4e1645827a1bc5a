r"""The names ``compression=`` takes and the exact size of their payloads (pure Python).

The gossip codecs (:mod:`decent_optim.gossip.codecs`, :mod:`decent_optim.gossip.sparse_codecs`)
and the runtime model both read sizes from here, so that a prediction counts the bytes a round
really sends. A name is ``bf16``, a value format alone (``int8``, ``int4``, ``int2``: every
element), or a sparsifier with an optional value format: ``rand<p>%`` or ``top<p>%`` followed by
``+int8``, ``+int4`` or ``+int2`` (without one the kept values travel as float32), e.g.
``rand1%``, ``top1%+int2``, ``rand0.5%+int4``.

Every codec but bf16 cuts the buffer into chunks of :data:`CHUNK` elements and keeps
:math:`k = \max(1, \mathrm{round}(p\, C / 100))` of each (all :math:`C` without a sparsifier),
so that the payload of :math:`n` elements has a fixed size and a range of chunks decodes alone.
Per chunk it sends :math:`k` values (4 bytes each as float32, else packed :math:`8/b` to a byte
for :math:`b` bits), a float32 scale when quantized, and for top-k the :math:`k` in-chunk
positions as uint16; random-k sends one 8-byte seed per payload instead of positions.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "BITS",
    "CHUNK",
    "CANDIDATES",
    "Spec",
    "bytes_per_element",
    "hidden",
    "hidden_text",
    "names_help",
    "parse",
]

#: elements per chunk (one scale and one fixed count of kept values each)
CHUNK = 1024
#: the value formats: bits per value (32: float32, unquantized)
BITS = {"int8": 8, "int4": 4, "int2": 2}
#: the largest level of each quantized format (levels :math:`-L..L`, symmetric)
LEVELS = {8: 127, 4: 7, 2: 1}
_SPARSE = re.compile(r"^(rand|top)(\d+(?:\.\d+)?)%(?:\+(int8|int4|int2))?$")


def names_help() -> str:
    return (
        "'bf16', 'int8', 'int4', 'int2', 'rand<p>%' or 'top<p>%' with 0 < p <= 100, "
        "optionally followed by '+int8', '+int4' or '+int2' (e.g. 'rand1%+int4', 'top1%+int2')"
    )


@dataclass(frozen=True)
class Spec:
    """A chunked codec: which values it keeps and how it sends them."""

    keep: str  # "all", "rand" or "top"
    percent: float  # of each chunk kept (100 for "all")
    bits: int  # bits per value: 32 (float32), 8, 4 or 2

    @property
    def name(self) -> str:
        if self.keep == "all":
            return f"int{self.bits}"
        fmt = "" if self.bits == 32 else f"+int{self.bits}"
        return f"{self.keep}{self.percent:g}%{fmt}"

    def kept(self, chunk: int = CHUNK) -> int:
        """Values kept per chunk of ``chunk`` elements."""
        if self.keep == "all":
            return chunk
        return min(chunk, max(1, round(self.percent * chunk / 100)))

    def row_bytes(self, chunk: int = CHUNK) -> int:
        """Bytes of one chunk's values (packed)."""
        k = self.kept(chunk)
        return 4 * k if self.bits == 32 else -(-k * self.bits // 8)

    def nbytes(self, numel: int, chunk: int = CHUNK) -> int:
        """Size of the payload of ``numel`` elements: seed, scales, values, positions."""
        chunks = -(-numel // chunk)
        seed = 8 if self.keep == "rand" else 0
        scales = 0 if self.bits == 32 else 4 * chunks
        positions = 2 * self.kept(chunk) * chunks if self.keep == "top" else 0
        return seed + scales + chunks * self.row_bytes(chunk) + positions


def parse(name: str) -> Spec | None:
    """The spec of a codec name; None for ``bf16``. ValueError for a name not of the grammar."""
    if name == "bf16":
        return None
    if name in BITS:
        return Spec("all", 100.0, BITS[name])
    found = _SPARSE.match(name)
    if found is None:
        raise ValueError(f"compression must be None or one of {names_help()}, got {name!r}")
    keep, percent, fmt = found.group(1), float(found.group(2)), found.group(3)
    if not 0 < percent <= 100:
        raise ValueError(
            f"compression {name!r}: the percentage must be in (0, 100]; {names_help()}"
        )
    return Spec(keep, percent, 32 if fmt is None else BITS[fmt])


def bytes_per_element(name: str) -> float:
    """Bytes on the wire per element of a long buffer (the seed of random-k left out)."""
    spec = parse(name)
    if spec is None:
        return 2.0
    return (spec.nbytes(CHUNK) - (8 if spec.keep == "rand" else 0)) / CHUNK


#: the codecs :func:`hidden` compares by default, most bytes first
CANDIDATES = (
    "bf16",
    "int8",
    "int4",
    "int2",
    "top10%+int8",
    "top10%+int4",
    "top1%+int8",
    "top1%+int4",
    "top1%+int2",
    "rand1%+int4",
    "rand1%+int2",
    "rand0.1%+int4",
)


def hidden(
    r: float, local_steps: int = 1, names: tuple[str, ...] = CANDIDATES, copies: float = 1.0
) -> tuple[list[tuple[str, float]], str | None]:
    r"""Which codec keeps a round hidden behind compute at ``r``.

    :math:`R` is the seconds one float32 copy of the model takes over a node's uplink divided by
    the seconds of one step; a round that sends ``copies`` compressed copies per uplink and
    direction then takes :math:`R \cdot w / 4 \cdot` ``copies`` steps to cross (:math:`w` the
    bytes per element), and stays hidden if that is at most ``local_steps`` (the steps it
    travels behind). Returns every name with its steps to cross, and the one with the most
    bytes (the least compression) that is hidden, None if none is.
    """
    rows = [(name, r * bytes_per_element(name) / 4 * copies) for name in names]
    fits = [name for name, steps in rows if steps <= local_steps]
    best = max(fits, key=bytes_per_element, default=None)
    return rows, best


def hidden_text(r: float, local_steps: Sequence[int] = (), names: Sequence[str] = ()) -> str:
    """:func:`hidden` for ``local_steps=1`` and each of ``local_steps``, as the plan prints it."""
    chosen = tuple(names) or CANDIDATES
    rows, _ = hidden(r, 1, chosen)
    lines = [f"R = {r:g}: steps a round takes over an uplink (one copy per direction): "]
    lines[0] += ", ".join(f"{name} {steps:.3g}" for name, steps in rows)
    for h in sorted({1, *local_steps}):
        best = hidden(r, h, chosen)[1]
        found = f"compression={best!r} keeps a round hidden" if best else "no round is hidden"
        lines.append(f"local_steps={h}: {found}")
    return "\n".join(lines)

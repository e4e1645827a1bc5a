r"""The regime R of a job and which codec keeps a gossip round hidden there (pure Python).

.. math::
    R = \frac{32 N / B}{S}

for a model of :math:`N` parameters, a node's uplink of :math:`B` bit/s and :math:`S` device
seconds per step: the steps one float32 copy of the model takes to cross the uplink. R is
defined on float32 whatever the job exchanges; a codec of :math:`w` bytes per element takes
:math:`R\, w / 4` steps per copy (:func:`~decent_optim.runtime.wire.hidden`).

:func:`recommend` names, for an R, the least-compressed codec whose round stays hidden at the
smallest ``local_steps`` of 1, 2, 4, 8 that has one (float32, no compression, first), and
beside it the smallest ``local_steps`` at which a round of float32, bf16 or int8 stays hidden,
the codecs that cost almost no quality. It predicts time only: what fewer rounds or a stronger
codec cost in steps to a loss is measured (``docs/time_to_quality.rst``,
``docs/algorithms.rst``), not predicted. The line to write, which weighs those measurements, is
:func:`decent_optim.recommend`'s: the one source of recommendations, which uses :func:`ratio`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from decent_optim.runtime.links import parse_rate
from decent_optim.runtime.wire import CANDIDATES, hidden, hidden_text, parse

__all__ = [
    "LOCAL_STEPS",
    "Recommendation",
    "link_bits",
    "ratio",
    "ratio_text",
    "recommend",
    "report",
]

#: the ``local_steps`` :func:`recommend` tries, fewest rounds skipped first
LOCAL_STEPS = (1, 2, 4, 8)
#: the codecs measured to cost almost no quality against exact gossip (None: float32)
_MILD = (None, "bf16", "int8")
#: upper bounds of the regime classes and what a copy costs there
_CLASSES = (
    (1.0, "R <= 1: a fast fabric, an uncompressed round crosses within a step"),
    (10.0, "1 < R <= 10: a copy takes a few steps"),
    (100.0, "10 < R <= 100: a copy takes tens of steps"),
    (float("inf"), "R > 100: a copy takes hundreds of steps or more"),
)
_LINK_HELP = "a rate in bits per second such as '100mbit', '400mbit', '1gbit' or '10gbit'"


def link_bits(text: str) -> float:
    """Bits per second of a rate written ``<number><unit>bit`` (``bit``, ``kbit`` ... ``tbit``)."""
    clean = text.strip().lower()
    if not clean.endswith("bit"):
        why = ""
        if clean.endswith("bps"):  # tc reads 'gbps' as gigabytes/s: an 8x error waiting to happen
            why = f"; in tc's units {text!r} is bytes per second: for bits write e.g. '10gbit'"
        raise ValueError(f"the link must be {_LINK_HELP}, got {text!r}{why}")
    try:
        bits = parse_rate(clean) * 8
    except ValueError:
        bits = float("nan")
    if not 0 < bits < float("inf"):
        raise ValueError(f"the link must be {_LINK_HELP} (finite, > 0), got {text!r}")
    return bits


def ratio(params: float, bits_per_s: float, step_s: float) -> float:
    """R: seconds of one float32 copy of ``params`` over ``bits_per_s`` / ``step_s``."""
    if not (params > 0 and bits_per_s > 0 and step_s > 0):
        raise ValueError(
            f"R needs params, link and step time > 0, got {params!r}, {bits_per_s!r}, {step_s!r}"
        )
    r = 32 * params / bits_per_s / step_s
    if not 0 < r < float("inf"):
        raise ValueError(f"R = 32 x {params!r} / {bits_per_s!r} / {step_s!r} is out of range: {r}")
    return r


def ratio_text(params: float, bits_per_s: float, step_s: float) -> str:
    """The arithmetic of :func:`ratio`, as the plan prints it."""
    copy_s = 32 * params / bits_per_s
    return (
        f"R = 32 bit x {params:.4g} parameters / {bits_per_s:.4g} bit/s = {copy_s:.4g} s per "
        f"float32 copy, / {step_s:.4g} s per step = {ratio(params, bits_per_s, step_s):.4g}"
    )


def _first_hidden(r: float, names: Sequence[str | None]) -> tuple[int, str | None, float] | None:
    """(local_steps, codec, steps per round) of the first H with a hidden round, or None."""
    coded = tuple(n for n in names if n is not None)
    for h in LOCAL_STEPS:
        if None in names and r <= h:  # float32: 4 bytes per element, R steps
            return h, None, r
        rows, best = hidden(r, h, coded) if coded else ([], None)
        if best is not None:
            return h, best, dict(rows)[best]
    return None


def _sparse_or_low_bit(name: str | None) -> bool:
    spec = None if name is None else parse(name)
    return spec is not None and (spec.keep != "all" or spec.bits < 8)


def _codec(name: str | None) -> str:
    return "compression=None (float32)" if name is None else f"compression={name!r}"


@dataclass(frozen=True)
class Recommendation:
    """The first hidden round at ``r``; ``local_steps`` None when no round is hidden."""

    r: float
    regime: str
    topology: str
    local_steps: int | None
    compression: str | None
    steps: float | None  # steps one round takes to cross the uplink
    mild: tuple[int, str | None, float] | None  # the same for float32, bf16 or int8 only

    def text(self) -> str:
        lines = [f"regime: {self.regime}"]
        if self.local_steps is None:
            lines.append(
                f"hidden first: no round of the codecs tried is hidden with local_steps <= "
                f"{LOCAL_STEPS[-1]}; try more --local-steps (the lines above), a stronger codec, "
                "or more work per step (R falls as the step grows)"
            )
        else:
            lines.append(
                f"hidden first: topology={self.topology!r}, local_steps={self.local_steps}, "
                f"{_codec(self.compression)}: a round crosses in {self.steps:.3g} steps"
            )
        mild = self.mild
        if mild is not None and (mild[0], mild[1]) != (self.local_steps, self.compression):
            lines.append(
                f"or, with a codec that costs almost no quality: local_steps={mild[0]}, "
                f"{_codec(mild[1])} ({mild[2]:.3g} steps per round)"
            )
        elif mild is None:
            lines.append(
                f"no round of float32, bf16 or int8 is hidden with local_steps <= {LOCAL_STEPS[-1]}"
            )
        lines.append("costs (quality costs are not predicted here; only training measures them):")
        if self.r <= 1:
            lines.append(
                "- All-Reduce (DDP) may be as fast at this R: run the plan under torchrun to "
                "compare them measured"
            )
        if (self.local_steps or 1) > 1 or (mild is not None and mild[0] > 1):
            lines.append(
                "- fewer rounds (local_steps > 1) cost steps to a given loss, more on short "
                "schedules: measured in docs/time_to_quality.rst"
            )
        if _sparse_or_low_bit(self.compression):
            lines.append(
                "- sparse and low-bit codecs mix slowly and cost quality: measured in "
                "docs/algorithms.rst, 'What they cost in training'"
            )
        if self.compression is not None or (mild is not None and mild[1] is not None):
            lines.append(
                "- a compressed round keeps public copies of the parameters (memory) and "
                "compresses between nodes only: docs/algorithms.rst, 'Compressed gossip'"
            )
        lines.append(
            f"- steps per round assume one copy per uplink and direction, what {self.topology}'s "
            "rounds across nodes send (ring where the node count is not a power of two); the "
            "codec's own work is not counted"
        )
        return "\n".join(lines)


def recommend(r: float, names: Sequence[str] = CANDIDATES) -> Recommendation:
    """The first hidden round at ``r``, among float32 and the codecs ``names`` (time only: the
    line to write is :func:`decent_optim.recommend`'s)."""
    if not r > 0:
        raise ValueError(f"R must be > 0, got {r!r}")
    regime = next(text for bound, text in _CLASSES if r <= bound)
    found = _first_hidden(r, (None, *names))
    h, codec, steps = found if found is not None else (None, None, None)
    mild = _first_hidden(r, _MILD)
    return Recommendation(r, regime, "alternating-exp-ring", h, codec, steps, mild)


def report(r: float, local_steps: Sequence[int] = (), names: Sequence[str] = ()) -> str:
    """What the plan prints for ``r``: each codec's steps per round, then :func:`recommend`."""
    return hidden_text(r, local_steps, names) + "\n\n" + recommend(r, names or CANDIDATES).text()

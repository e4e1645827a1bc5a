"""A cadence of local steps whose period doubles after a warm-up: few rounds early, half as many late.

``local_steps=DoublingPeriods(local_steps=H, after=W)``: periods of ``H`` steps until ``W``
steps were taken (``W`` a multiple of ``H``), then of ``2H``. Early in training the models
drift apart fastest, so they are mixed more often there; later a round every ``2H`` steps
halves the bytes. Everything else is step-locked local steps'
(:class:`~decent_optim.optim.local_steps.StepLocked`: the anchors travel during the next
period; any ``outer=``); a slow step
(``LocalOuterSGD(every=K)``) must fall at a period's end on both sides of ``W``.
"""

from __future__ import annotations

from dataclasses import dataclass

from decent_optim.optim.local_steps import Periods

__all__ = ["DoublingPeriods"]


@dataclass(frozen=True)
class DoublingPeriods(Periods):
    """Periods of ``local_steps`` steps up to ``after`` steps, then of ``2 * local_steps``."""

    after: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.local_steps, bool) or not isinstance(self.local_steps, int):
            raise TypeError(f"DoublingPeriods.local_steps must be an int, got {self.local_steps!r}")
        if self.local_steps < 1:
            raise ValueError(f"DoublingPeriods.local_steps must be >= 1, got {self.local_steps}")
        if not isinstance(self.after, int) or self.after < 0 or self.after % self.local_steps:
            raise ValueError(
                f"DoublingPeriods.after must be a multiple of local_steps={self.local_steps} "
                f"(>= 0): the warm-up ends at a period's end, got {self.after!r}"
            )

    def ends(self, count: int) -> bool:
        if count <= self.after:
            return count % self.local_steps == 0
        return (count - self.after) % (2 * self.local_steps) == 0

    def start(self, count: int) -> int:
        if count <= self.after:
            return count - count % self.local_steps
        return count - (count - self.after) % (2 * self.local_steps)

    def index(self, count: int) -> int:
        if count <= self.after:
            return count // self.local_steps
        return self.after // self.local_steps + (count - self.after) // (2 * self.local_steps)

r"""What happens at a period's end: the settings of ``outer=`` and the part that carries each out.

The rounds of local steps (:mod:`~decent_optim.optim.local_steps`, and the uneven periods of
:mod:`~decent_optim.optim.uneven`) hold one *period end*, chosen by
:func:`~decent_optim.optim.schedules.make_rounds` from ``outer=``; it owns its state, which
checkpoints and newcomers read through :meth:`PeriodEnd.state`:

* :class:`PeriodEnd` (``outer=None``): nothing; the anchor becomes the parameters.
* :class:`AnchorOuter` (``outer="diloco"`` or an :class:`OuterSGD`): DiLoCo's outer step on the
  anchors, whose round is then waited for (:attr:`PeriodEnd.waits`); the maths is in
  :mod:`~decent_optim.optim.local_steps`.
* :class:`SlowOuter` (``outer=LocalOuterSGD(lr=eta, momentum=mu, every=K)``): an outer step on
  each rank's own *slow weights* :math:`\theta_i`, with the pseudo-gradient of its steps since
  the last one, before the period's anchor is taken:

  .. math::
      \Delta_i = \theta_i - x_i, \qquad b_i \leftarrow \mu b_i + \Delta_i, \qquad
      \theta_i \leftarrow \theta_i - \eta (\Delta_i + \mu b_i) \ \text{(Nesterov; else }
      \eta b_i), \qquad x_i \leftarrow \theta_i .

  It needs no round of its own, so it costs no waiting: the step-:math:`K` Nesterov outer
  optimizer (SNOO, Kallusky et al. 2025) of each rank's own model, while the rounds keep the
  models, and so the :math:`\Delta_i`, close. The :math:`\theta_i` start as the parameters at
  the first step.

**When the slow step comes** is one rule for every cadence, in the ranks' summed step counts
:math:`S` that every rank knows alike: the step after which :math:`\lfloor S / (nK) \rfloor`
grew (:meth:`SlowOuter.crossed`). Step-locked ranks know :math:`S = n c` at their count
:math:`c`, so it is every :math:`K` steps (``K`` a multiple of ``local_steps``: at a period's
end). Uneven ranks learn :math:`S_k` at the round :math:`k` they mix, so every rank takes it
at the same round, in the step that mixes it, after the update and before the anchor of round
:math:`k + 1` is taken (a round mixed by ``synchronize()`` takes it at once); there ``K`` need
not be a multiple of ``local_steps``, and ``every < local_steps`` means every round.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "AnchorOuter",
    "LocalOuterSGD",
    "OuterSGD",
    "PeriodEnd",
    "SlowOuter",
    "check_outer_rates",
    "sgd_outer_step",
]


@dataclass(frozen=True)
class OuterSGD:
    """The outer optimizer of ``outer=``: torch.optim.SGD's momentum step on the pseudo-gradient.

    ``outer="diloco"`` is ``OuterSGD(lr=0.7, momentum=0.9, nesterov=True)``, DiLoCo's published
    setting (Douillard et al. 2023). ``OuterSGD(lr=1.0, momentum=0.0, nesterov=False)`` is the
    plain mode (the anchor is the parameters).
    """

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True

    def __post_init__(self) -> None:
        check_outer_rates("OuterSGD", self.lr, self.momentum, self.nesterov)
        # plain numbers (numpy's too), so that the setting a checkpoint records reads alike
        object.__setattr__(self, "lr", float(self.lr))
        object.__setattr__(self, "momentum", float(self.momentum))


@dataclass(frozen=True)
class LocalOuterSGD:
    """The outer step of ``outer=LocalOuterSGD(...)``: each rank's own, every ``every`` steps.

    The defaults are the measured recommendation for ``local_steps=4`` (docs: "Fewer steps: an
    outer step on each rank's slow weights"): outer lr 0.5, Nesterov momentum 0.7, every 32
    steps. ``every`` must be a multiple of ``local_steps``, except with ``uneven=True``, where
    it counts DDP-equivalent steps (:mod:`~decent_optim.optim.outer`). With
    ``local_steps=2, uneven=True`` at 16 workers, ``every=16, lr=0.7, momentum=0.5`` was
    measured best (docs: "The outer step at sixteen workers"); the defaults overshoot there.
    """

    lr: float = 0.5
    momentum: float = 0.7
    every: int = 32
    nesterov: bool = True

    def __post_init__(self) -> None:
        check_outer_rates("LocalOuterSGD", self.lr, self.momentum, self.nesterov)
        if self.momentum >= 1:
            raise ValueError(f"LocalOuterSGD.momentum must be < 1, got {self.momentum!r}")
        every = self.every
        if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 1:
            raise ValueError(
                f"LocalOuterSGD.every must be an int >= 1 (steps between outer steps), got "
                f"{self.every!r}"
            )
        # plain numbers (numpy's too), so that the setting a checkpoint records reads alike
        object.__setattr__(self, "every", int(every))
        object.__setattr__(self, "lr", float(self.lr))
        object.__setattr__(self, "momentum", float(self.momentum))


def check_outer_rates(owner: str, lr: object, momentum: object, nesterov: object) -> None:
    """The checks every outer-step setting shares, with errors naming ``owner``."""
    for name, value in (("lr", lr), ("momentum", momentum)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{owner}.{name} must be a number, got {type(value).__name__}")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{owner}.{name} must be a finite number >= 0, got {value!r}")
    if not lr > 0:  # type: ignore[operator]
        raise ValueError(f"{owner}.lr must be > 0, got {lr!r} (0 would never move)")
    if not isinstance(nesterov, bool):
        raise TypeError(f"{owner}.nesterov must be a bool, got {nesterov!r}")
    if nesterov and momentum == 0:
        raise ValueError(f"{owner}: Nesterov needs a momentum > 0 (or pass nesterov=False)")


def sgd_outer_step(
    theta: Tensor, x: Tensor, buf: Tensor | None, lr: float, momentum: float, nesterov: bool
) -> Tensor | None:
    """torch.optim.SGD's step on ``theta`` with the pseudo-gradient ``theta - x``, then
    ``x = theta``. Returns the momentum buffer (None without momentum)."""
    delta = torch.sub(theta, x)
    step = delta
    if momentum:
        # as torch.optim.SGD: the buffer starts as the first gradient
        buf = delta.clone() if buf is None else buf.mul_(momentum).add_(delta)
        step = delta.add_(buf, alpha=momentum) if nesterov else buf
    theta.sub_(step, alpha=lr)
    x.copy_(theta)
    return buf


def _outer_steps(
    targets: list[Tensor], buffers: list[Tensor], old: list[Tensor] | None, outer: object
) -> list[Tensor] | None:
    """:func:`sgd_outer_step` on every bucket; the momentum buffers (None without momentum)."""
    lr, momentum, nesterov = outer.lr, outer.momentum, outer.nesterov  # type: ignore[attr-defined]
    bufs: list[Tensor | None] = list(old) if old is not None else [None] * len(targets)
    with torch.no_grad():
        new = [
            sgd_outer_step(t, x, b, lr, momentum, nesterov)
            for x, t, b in zip(buffers, targets, bufs)
        ]
    return [b for b in new if b is not None] or None


class PeriodEnd:
    """``outer=None``: at a period's end the anchor becomes the parameters; no state."""

    #: the setting a checkpoint records (its ``"outer"``) and a resume must match
    setting: object = None
    #: whether the period's round is mixed at once instead of during the next period
    waits = False

    def state(self) -> dict[str, list[Tensor] | None]:
        """Checkpoint key -> one flat per bucket (None: not taken yet), after the anchors."""
        return {}

    def load(self, key: str, flats: list[Tensor]) -> None:
        """Take back one entry of :meth:`state` (a checkpoint, or a newcomer's source)."""
        raise KeyError(key)

    def reset(self) -> None:
        """Forget the state (a resume: the checkpoint's comes next, or the parameters')."""

    def start(self, buffers: list[Tensor]) -> None:
        """At each step before its update: state not taken yet starts as the parameters."""

    def crossed(self, before: float | None, after: float | None, world: int) -> bool:
        """Whether the slow step is due now that the ranks' summed steps went from ``before``
        to ``after`` (:class:`SlowOuter`; never here)."""
        return False

    def slow_step(self, buffers: list[Tensor]) -> None:
        """The outer step on the rank's own slow weights (:class:`SlowOuter`)."""

    def anchor_step(self, buffers: list[Tensor], anchor: list[Tensor]) -> None:
        """At a period's end, before its round is launched with ``anchor``."""
        with torch.no_grad():
            for x, a in zip(buffers, anchor):
                a.copy_(x)


class AnchorOuter(PeriodEnd):
    """DiLoCo's outer step on the anchors (``outer=OuterSGD``), and its momentum."""

    waits = True  # a period started from the unmixed outer step trained far worse (local_steps)

    def __init__(self, outer: OuterSGD) -> None:
        self.setting, self.outer = outer, outer
        self.momentum: list[Tensor] | None = None  # from the first outer step

    def state(self) -> dict[str, list[Tensor] | None]:
        return {"outer_momentum": self.momentum}

    def load(self, key: str, flats: list[Tensor]) -> None:
        assert key == "outer_momentum", key
        self.momentum = flats

    def reset(self) -> None:
        self.momentum = None

    def anchor_step(self, buffers: list[Tensor], anchor: list[Tensor]) -> None:
        self.momentum = _outer_steps(anchor, buffers, self.momentum, self.outer)


class SlowOuter(PeriodEnd):
    """The outer step on each rank's own slow weights (``outer=LocalOuterSGD``), their momentum."""

    def __init__(self, outer: LocalOuterSGD) -> None:
        self.setting, self.outer = outer, outer
        self.slow: list[Tensor] | None = None  # the slow weights, from the first step
        self.slow_momentum: list[Tensor] | None = None  # from the first outer step

    def state(self) -> dict[str, list[Tensor] | None]:
        return {"slow": self.slow, "slow_momentum": self.slow_momentum}

    def load(self, key: str, flats: list[Tensor]) -> None:
        assert key in ("slow", "slow_momentum"), key
        setattr(self, key, flats)

    def reset(self) -> None:
        self.slow = self.slow_momentum = None

    def start(self, buffers: list[Tensor]) -> None:
        if self.slow is None:
            self.slow = [b.clone() for b in buffers]

    def crossed(self, before: float | None, after: float | None, world: int) -> bool:
        """The rule of the module docstring: :math:`\\lfloor S / (nK) \\rfloor` grew."""
        if after is None:
            return False
        period = world * self.outer.every
        return int(after) // period > (0 if before is None else int(before)) // period

    def slow_step(self, buffers: list[Tensor]) -> None:
        if self.slow is not None:  # (synchronize() before the first step: nothing to step)
            self.slow_momentum = _outer_steps(self.slow, buffers, self.slow_momentum, self.outer)

r"""Uneven workers with the outer step on each rank's slow weights, counted in DDP-equivalent steps.

``local_steps=H, uneven=True, outer=LocalOuterSGD(lr=eta, momentum=mu, every=K)``: the rounds are
those of :mod:`~decent_optim.optim.uneven` (a period lasts until the neighbours' round is in),
and the outer step is :mod:`~decent_optim.optim.slow_outer`'s: torch.optim.SGD's momentum step
on rank :math:`i`'s slow weights with the pseudo-gradient :math:`\theta_i - x_i`, then
:math:`x_i \leftarrow \theta_i`.

Uneven ranks take their own numbers of steps, so "every :math:`K` steps" cannot be the own
count: the ranks would step at different rounds, some in the middle of a period. It is counted
in DDP-equivalent progress instead, which every rank learns at the same round: with
:math:`S_k` the ranks' summed step counts at the launches of round :math:`k`
(:math:`S_0 = 0`) and :math:`n` ranks, in the step that mixes round :math:`k`

.. math::
    \left\lfloor \frac{S_k}{nK} \right\rfloor > \left\lfloor \frac{S_{k-1}}{nK} \right\rfloor
    \quad\Longrightarrow\quad \text{the outer step, after that step's update,}

before the anchor of round :math:`k+1` is taken, so that round carries
:math:`x_i = \theta_i`. Every rank takes it at the same round, each with the pseudo-gradient
of its own steps since its last one. A round mixed by ``synchronize()`` (between steps) takes
it at once instead.

``K`` need not be a multiple of ``H`` here: the :math:`S_k / n` of the rounds are not
multiples of :math:`H` anyway. Every period adds at least :math:`H` to :math:`S_k / n`, and
the outer step comes at most once per round, so ``every < local_steps`` means every round.
The slow weights start as the parameters at the first step; checkpoints save them and their
momentum with the anchors (:mod:`~decent_optim.optim.local_checkpoint`), and a resume at
another world size averages them as every other state.
"""

# annotations evaluated (no `from __future__ import annotations`): the docs then link `outer`'s
# type to its class; as the bare name "LocalOuterSGD" it would match two documented targets
from decent_optim.flat import FlatParams
from decent_optim.gossip import Gossiper, LocalGossiper
from decent_optim.optim.slow_outer import LocalOuterSGD, SlowWeights
from decent_optim.optim.uneven import UnevenRounds

__all__ = ["UnevenOuterRounds"]


class UnevenOuterRounds(SlowWeights, UnevenRounds):
    """The uneven rounds, and the outer step of the module docstring at the rounds it names."""

    SAVED = {**UnevenRounds.SAVED, **SlowWeights.SAVED_SLOW}

    def __init__(
        self,
        gossip: Gossiper | LocalGossiper,
        flat: FlatParams,
        local_steps: int,
        outer: LocalOuterSGD,
        cap: float | None = None,
        adaptive: bool = False,
    ) -> None:
        super().__init__(gossip, flat, local_steps, cap, adaptive)
        self.slow_outer = outer
        self.slow = self.slow_momentum = None
        self._due = False  # this step mixed a round that crossed a multiple of `every`

    @property
    def setting(self) -> LocalOuterSGD:
        return self.slow_outer

    def take(self) -> None:  # type: ignore[override]
        """As uneven rounds; notes whether the round mixed now (if any) calls for the outer step."""
        mixed, total = self.mixed, self.total
        super().take()
        self.start_slow(self._flat.buffers)
        self._due = self._crossed(mixed, total)

    def launch(self) -> None:
        """After the update: the outer step if :meth:`take` called for it, then as uneven rounds
        (count the step, maybe launch the next round with the new anchors)."""
        if self._due:
            self._due = False
            self.slow_step(self._flat.buffers)
        super().launch()

    def synchronize(self) -> None:
        """Mix the round in flight now; the outer step at once if that round calls for it."""
        mixed, total = self.mixed, self.total
        super().synchronize()
        if self.slow is not None and self._crossed(mixed, total):
            self.slow_step(self._flat.buffers)

    def reset(self, count: int, in_flight: bool) -> None:
        """Continue from a checkpoint; slow weights come from it too, else from the parameters."""
        super().reset(count, in_flight)
        self.slow = self.slow_momentum = None

    def _crossed(self, mixed: int, total: float | None) -> bool:
        """Whether a round was mixed since :attr:`mixed` was ``mixed`` (its summed steps then
        ``total``) and its DDP-equivalent progress crossed a multiple of ``every``."""
        if self.mixed == mixed or self.total is None:
            return False
        period = self.gossip.world_size * self.slow_outer.every
        before = 0 if total is None else int(total)
        return int(self.total) // period > before // period

r"""Live membership with ``uneven=True``: a worker lost while the others take uneven steps.

With ``membership=`` (:mod:`~decent_optim.optim.live`) a failed round of
:class:`~decent_optim.optim.uneven.UnevenRounds` does not raise. A dead neighbour fails the
round's transfers; every rank's sum of step counts fails too (it talks to every rank), and a
hung (stopped) worker fails them after the optimizer's ``timeout``; a rank whose own round
still completes learns of the change from the store, in its next round's watched wait. The
rank notices in the step that would mix the round, once the round's waiter thread has ended
(:meth:`~decent_optim.optim.uneven.UnevenRounds._settle` joins it first, so no wait of this
optimizer is left on the old group), or when launching a round fails or finds a change asked
for in the store. Then it

1. drops the round in flight and its sum: nothing of that round is mixed in, the parameters
   stay its own values, the step's update is applied as usual;
2. agrees with the other survivors and rebuilds the group, topology and gossiper exactly as
   the step-locked schedules do (:meth:`Live.recover <decent_optim.optim.live.Live.recover>`,
   with the callback and :attr:`~decent_optim.DecentralizedOptimizer.membership`). It names
   a suspect only where the failed wait names one peer (its connection closed): a timed-out
   sum names every rank after the first late one, live ones too. A hung worker, named by no
   one, is left out once the others have waited twice the timeout of
   :class:`~decent_optim.gossip.membership.Membership` for it;
3. goes on at round :math:`R`, the largest :attr:`~UnevenRounds.round` of the survivors:
   since every rank mixes round :math:`k` only after every rank launched it, the survivors'
   rounds differ by at most one, and one whose count is lower counts its dropped round as
   done. :attr:`~UnevenRounds.round` is then the same on every survivor, and they launch round
   :math:`R + 1` on the new group as soon as each has taken ``local_steps`` steps since its
   last launch (the periods restart at ``local_steps``: old speeds say nothing of the new
   group).

**The mean.** From each survivor's parameters right after its change on, every round is a
doubly stochastic mix over the survivors, so their mean moves by the mean of their local
updates only; the lost worker's steps stay in what its neighbours mixed before it died.

**The budget.** The progress carries over as a resize by ``checkpoint.load`` carries it
(:meth:`~UnevenRounds.load_schedule_state`): a survivor's progress :math:`P = S_k / n` at its
last mixed round becomes :math:`n' P` summed over the :math:`n'` survivors, and it adds
:math:`P - c_k` to the count it sends. The survivors then stop at the first round of the new
group at which :math:`S / n' + H` reaches the budget of :meth:`~UnevenRounds.stop_at`, where
:math:`S / n'` is the progress at the change plus the survivors' mean steps since: the same
budget of DDP-equivalent steps, the steps after the change counted over the survivors. Every
survivor reads the same sums, so all stop after the same round, and none waits for a round no
one sends. A loss in the budget's last round can leave a rank that mixed it (and stopped)
outside the new group: it stopped and is done; the others declare it dead after twice
``Membership``'s timeout and finish without it.

**A join** (:mod:`~decent_optim.optim.joining`). The members look for a newcomer's request
once per round, before each launch (one check of a store key), and take it in by steps 1-3 (a
round in flight is dropped); new rank 0 then sends the newcomer its state and step count
:math:`c_0`. The newcomer stands at round :math:`R`, counts from :math:`c_0` (its progress is
:math:`c_0` plus its own steps until it mixes its first round), and launches round
:math:`R + 1` at the end of its first step. The members' progress carries over as above, so the
first round mixed after the join sets everyone's progress to the mean of the members' and
:math:`c_0`, plus the steps since: it moves by about :math:`(c_0 - P_0) / (n + 1)`, for the
source's progress :math:`P_0`.

Not supported: ``outer=`` with ``uneven=True``.
"""

from __future__ import annotations

from typing import Any, Protocol

from decent_optim.gossip import GossipError
from decent_optim.gossip.failures import connection_closed
from decent_optim.gossip.membership import MembershipChanged

__all__ = ["Regrouping", "launching", "recover"]


class Regrouping(Protocol):
    """What recovery asks of the uneven rounds (:class:`~decent_optim.optim.uneven.UnevenRounds`)."""

    live: Any  # the rounds' Members (optim.rounds), None without membership=
    gossip: Any
    mixed: int

    def regrouped(self, before: int) -> None:
        """Stand at round ``live.resume`` on the new group (``before``: the old group's size)."""


def recover(rounds: Regrouping, error: BaseException) -> None:
    """Steps 1-3 of the module docstring after ``error`` ended a round of ``rounds`` (its waiter
    joined); re-raise ``error`` without live membership or when it is no transport failure."""
    live = rounds.live
    transport = isinstance(error, GossipError) or (
        isinstance(error, RuntimeError) and connection_closed(error)
    )
    if live is None or not transport:
        raise error
    before = rounds.gossip.world_size
    # one peer named: its connection closed; several: a timed-out wait (step 2)
    peers = getattr(error, "peers", ())
    live.recover(rounds, peers if len(peers) == 1 else (), rounds.mixed)  # live.resume: the max
    rounds.regrouped(before)
    failed = live.hand_over(rounds)  # this rank is the source of newcomers' state
    if failed is not None:
        error = GossipError(f"a newcomer's state transfer failed (ranks {list(failed)})")
        error.peers = failed
        recover(rounds, error)


def launching(rounds: Regrouping) -> None:
    """Before launching a round: raise :class:`MembershipChanged` if a member or a newcomer
    asked for a change (one check of a store key). A round's watched wait notices it only
    while the round is still travelling."""
    live = rounds.live
    if live is not None and live.membership.pending():
        raise MembershipChanged(f"[id {live.membership.me}] a change of membership was asked for")

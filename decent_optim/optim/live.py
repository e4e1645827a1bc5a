r"""Live membership: when a worker dies, the others' ``step()`` returns and they train on.

Pass ``membership=Membership(store, timeout=...)``
(:class:`decent_optim.gossip.membership.Membership`, built right after ``init_process_group``
on a store that outlives every worker) to an optimizer. When a round fails in ``step()`` -- a
neighbour's connection closed, a neighbour timed out, or another member started a change --
the step does not raise. Instead this rank

1. drops the round that failed: its parameters stay its own values (nothing of that round is
   mixed in), the step's local update is applied to them as usual;
2. agrees with the other survivors on who is left, and rebuilds the default process group
   among them (ranks ``0..n-1`` in the order of their old ranks;
   :meth:`Membership.rebuild <decent_optim.gossip.membership.Membership.rebuild>`);
3. builds the topology of the same name for the new size (:func:`topology_for`) and gossips
   on the new group from the next round on;
4. tells the callback ``on_membership_change(view)``, if given, so that the training loop can
   reshard its data; :attr:`~decent_optim.DecentralizedOptimizer.membership` holds the view.

The survivors notice the loss at different steps (a rank two hops away one round later), so
their step counts at the change differ by a step or two (a period or two with
``local_steps``). Gossip resumes at the largest, :math:`R`: a survivor whose count is lower
takes its steps up to :math:`R` without gossip (they are its own steps, kept), then every
survivor launches round :math:`R` and the rounds are step-locked again. With
``local_steps=H`` the same holds for periods (the counts are multiples of :math:`H`; the failed
period's round is dropped, the anchors restart from the parameters).

What becomes of the progress: each survivor continues from its own current parameters, so the
mean over the survivors is the new consensus, and gossip preserves it from then on. The lost
worker's own steps are gone, except what its neighbours mixed in from its rounds that completed
before it died; the round in flight at the failure is dropped on every survivor. Nobody
restarts, and no step is lost, but the survivors' data must be resharded by the loop if the
lost worker's share matters.

A worker started while the job runs joins it with ``Membership(store, join=True)``: the members
read the store once per round (:meth:`Membership.pending
<decent_optim.gossip.membership.Membership.pending>`, one key), take it in by the same steps
2-4, and new rank 0 sends it its state (:mod:`decent_optim.optim.joining`).

With ``uneven=True`` (:mod:`~decent_optim.optim.uneven`) the same steps 2-4 run through the
same object, at the rounds instead of the step counts: a rank notices a failure in the step
that would mix the round (once the round's waiter thread ended, so no wait is left on the old
group) or when a launch fails or finds a change asked for (:meth:`Live.failed`,
:meth:`Live.asked`); the survivors go on at the largest ``opt.round`` (they differ by at most
one), the progress carries over as a resize carries it, and the periods restart
(``regrouped`` of the rounds). A newcomer stands at round :math:`R` and launches round
:math:`R + 1` after its first step. The derivation of the mean and the budget is in
``docs/surviving_failures.rst`` ("With uneven workers").

With ``compression=``, the public copies of compressed gossip
(:mod:`decent_optim.gossip.compressed`) belong to the groups of the old topology: at a change
every member (a newcomer too) builds its new gossiper with the same codec and no copies, so
the first round of each new group sends exact values on all of them alike, as after a resume at
another world size, and the copies are rebuilt from there.

Supported: every schedule of rounds -- ``local_steps=1``, and ``local_steps=H`` with or
without ``outer`` and ``uneven=True`` (the outer step on the anchors, or on each rank's slow
weights: each survivor keeps its own; a newcomer receives the source's, as a resume would) --
with exact or compressed gossip, over the default process group, a topology given by name, and
one decentralized optimizer per process. Everything else is refused when the
optimizer is built. Other collectives of the optimizer (``synchronize()``, ``averaged()``,
``consensus_distance()``, ``checkpoint.load``) still raise a ``GossipError`` when a member is
lost during them; after a change the first three run over the new group. Checkpoints saved
after a change are of the new world size, and a fresh world of that size resumes from them (a
commit still waiting for a lost member's file gives up: :func:`superseded`).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from decent_optim.gossip import Gossiper, GossipError, GossipHandle
from decent_optim.gossip.failures import connection_closed
from decent_optim.gossip.live import gossiper, regroup, topology_for
from decent_optim.gossip.membership import Membership, MembershipChanged, View
from decent_optim.optim import joining
from decent_optim.topologies import Topology

if TYPE_CHECKING:
    import datetime

    from decent_optim.gossip.codec_base import Codec
    from decent_optim.optim.rounds import Rounds
    from decent_optim.optim.startup import Connected

__all__ = ["Live", "attach", "check", "superseded", "topology_for"]

#: the settings live membership supports, for the refusals' messages
SUPPORTED = (
    "membership= supports local_steps=1, or local_steps=H with any outer= and uneven=, exact "
    "or with compression=, over the default process group (process_group=None) and a topology "
    "given by name"
)


def check(
    membership: object,
    on_change: object,
    topology: object,
    process_group: object,
) -> None:
    """Refuse a ``membership=`` setting live membership does not support, saying what is."""
    if membership is None:
        if on_change is not None:
            raise ValueError("on_membership_change= needs membership=Membership(store, ...)")
        return
    if not isinstance(membership, Membership):
        raise TypeError(
            "membership= takes a decent_optim.gossip.membership.Membership(store, timeout=...), "
            f"got {type(membership).__name__}"
        )
    if on_change is not None and not callable(on_change):
        raise TypeError(f"on_membership_change= must be callable, got {on_change!r}")
    refused = []
    if process_group is not None:
        refused.append("process_group= (the survivors rebuild the default group)")
    if not isinstance(topology, str):
        refused.append(f"topology={topology!r} (it is built for one size; pass its name)")
    if refused:
        raise ValueError(f"{SUPPORTED}; not {', '.join(refused)}")


def superseded(owner: Any, every: float = 0.2) -> Callable[[], bool]:
    """Whether the group of the optimizer ``owner`` has changed, or a member started a change,
    at least half the membership's ``timeout`` ago (a live member's file arrives by then; a lost
    one's never does), counted from this call; always False without ``membership=``. A
    checkpoint's commit that waits for the ranks' files gives up then
    (:mod:`decent_optim.checkpoint.saving`). Callable from another thread; it reads one store
    key at most every ``every`` seconds, and stays True once it is."""
    live = getattr(getattr(owner, "_rounds", None), "live", None)
    if not isinstance(live, Live):
        return lambda: False
    generation, last = live.view.generation, [-every]
    seen: list[float] = []  # when a change was first seen

    def changed() -> bool:
        now = time.monotonic()
        if not seen and now - last[0] >= every:
            last[0] = now
            if live.view.generation != generation or live.membership.pending():
                seen.append(now)
        # half: rank 0 blocked here must still post in the agreement, which waits 2 timeouts
        return bool(seen) and now - seen[0] >= live.membership.timeout / 2

    return changed


def attach(
    owner: Any,
    start: Connected,
    membership: Membership | None,
    on_change: Callable[[View], object] | None,
    topology: object,
    compression: str | Codec | None = None,
) -> Live | None:
    """The live membership of the optimizer ``owner`` just started (``start``), if it has one
    (``compression``: its codec, for the gossipers of the groups to come)."""
    if membership is None or not isinstance(start.gossip, Gossiper):
        return None  # a world of one has nobody to lose
    start.gossip.watch = membership.watch
    width, timeout = start.topology.local_world_size, start.gossip.timeout
    live = Live(owner, membership, on_change, str(topology), width, timeout, start.member.slot)
    live.compression, live.deferred = compression, start.gossip.deferred
    return live


class Live:
    """The live membership of one optimizer (``owner``), hooked into its rounds."""

    def __init__(
        self,
        owner: Any,
        membership: Membership,
        on_change: Callable[[View], object] | None,
        topology: str,
        local_world_size: int,
        timeout: datetime.timedelta | None,
        slot: int,
    ) -> None:
        self._owner = weakref.ref(owner)  # the optimizer holds this object
        self.membership, self.on_change = membership, on_change
        self.topology, self.width = topology, local_world_size
        self.timeout, self.slot = timeout, slot
        self.resume = 0  # rounds below this are not launched (a survivor catching up)
        self.joiners: tuple[int, ...] = ()  # newcomers this rank (the source) owes the state
        self.compression: str | Codec | None = None  # the codec of every gossiper it builds
        self.deferred = False  # and whether its node rounds wait only in the round's wait

    @property
    def view(self) -> View:
        """The current group: generation, members (ids), this rank, the ids lost last."""
        return self.membership.view

    def arrived(self, rounds: Rounds, handle: GossipHandle, after: int) -> bool:
        """Wait for ``handle``'s round; on a failure drop it, rebuild, and return False."""
        try:
            handle.wait()
            return True
        except GossipError as err:
            peers = err.peers
        self.recover(rounds, peers, after)
        return False

    def send(self, rounds: Rounds) -> None:
        """Launch round ``rounds.count``, unless this rank is catching up after a change; first
        hand the state to newcomers, and look for a change asked for (a newcomer's)."""
        rounds.drop()
        failed = self.hand_over(rounds)
        if failed is not None:
            self.recover(rounds, failed, rounds.count)
            return self.send(rounds)
        if self.membership.pending():  # one check of a store key per round
            self.recover(rounds, (), rounds.count)
            return self.send(rounds)
        if rounds.count < self.resume:
            return
        try:
            rounds.start_round()
        except GossipError as err:
            peers = err.peers
        else:
            return
        self.recover(rounds, peers, rounds.count)
        self.send(rounds)

    def hand_over(self, rounds: Rounds) -> tuple[int, ...] | None:
        """Send the newcomers this rank owes it their state (:func:`joining.hand_over
        <decent_optim.optim.joining.hand_over>`): None, or the ranks to declare lost."""
        joiners, self.joiners = self.joiners, ()
        return joining.hand_over(self, rounds, joiners) if joiners else None

    def recover(self, rounds: Rounds, suspects: tuple[int, ...], after: int) -> None:
        """Steps 2-4 of the module docstring (``after``: this rank's count at the step's end)."""
        rounds.drop()
        if isinstance(rounds.gossip, Gossiper):
            rounds.gossip.watch = None  # of the old group, which is about to go
        before = set(self.view.members)
        new = regroup(
            self.membership,
            suspects,
            after,
            lambda view: topology_for(self.topology, view, self.width),
            timeout=self.timeout,
            slot=self.slot,
            compression=self.compression,
            deferred=self.deferred,
        )
        rounds.gossip, self.resume = new.gossip, new.resume
        if new.view.rank == 0:  # the source of the newcomers' state (optim.joining)
            self.joiners = tuple(r for r, i in enumerate(new.view.members) if i not in before)
        owner = self._owner()
        if owner is not None:  # its topology, and the group of load_state_dict's cross-check
            owner.topology, owner._where = new.gossip.topology, (new.group, owner._where[1])
        if self.on_change is not None:
            self.on_change(new.view)

    def failed(self, rounds: Rounds, error: BaseException) -> None:
        """Uneven periods: ``error`` ended a round (its waiter joined, or its launch): steps
        2-4 with the survivors' largest :attr:`~Rounds.round`, then ``rounds.regrouped`` and
        the newcomers' state at once; re-raise ``error`` when it is no transport failure."""
        transport = isinstance(error, GossipError) or (
            isinstance(error, RuntimeError) and connection_closed(error)
        )
        if not transport:
            raise error
        before = rounds.gossip.world_size
        # one peer named: its connection closed; several: a timed-out wait (step 2)
        peers = getattr(error, "peers", ())
        self.recover(rounds, peers if len(peers) == 1 else (), rounds.round)  # resume: the max
        rounds.regrouped(before)
        lost = self.hand_over(rounds)  # this rank is the source of newcomers' state
        if lost is not None:
            error = GossipError(f"a newcomer's state transfer failed (ranks {list(lost)})")
            error.peers = lost
            self.failed(rounds, error)

    def asked(self) -> None:
        """Uneven periods, before a launch: raise :class:`MembershipChanged` if a member or a
        newcomer asked for a change (one check of a store key); a round's watched wait notices
        one only while the round is still travelling."""
        if self.membership.pending():
            raise MembershipChanged(
                f"[id {self.membership.me}] a change of membership was asked for"
            )

    def adopt(self, rounds: Rounds, width: int, slot: int) -> Topology:
        """A newcomer's gossip at the members' ``local_world_size`` and slot (optim.joining)."""
        self.width, self.slot = width, slot
        topo = topology_for(self.topology, self.view, width)
        rounds.gossip = gossiper(
            self.membership, topo, slot, self.timeout, self.compression, self.deferred
        )
        return topo

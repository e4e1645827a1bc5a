"""Live membership: the survivors of a lost rank agree on who is left and rebuild their group.

A torch.distributed process group is fixed at creation. When a member dies, each survivor calls
:meth:`Membership.rebuild` with the ranks it believes dead (the peers of a failed wait); the
survivors agree on one member list through a store that outlives every worker (torchrun's agent
store, or a ``TCPStore`` on a host that does not train), then destroy their process groups and
initialise a new default group among themselves, on a ``PrefixStore`` of the new generation so
that no key of an older group is read again. Measured against ``new_group`` and ``shrink_group``
in ``experiments/live_membership/rebuild.py`` (docs/surviving_failures, "Live membership").

Agreement, generation ``g`` (keys ``{prefix}/g{g}/...``). A member is known by its *id*, its rank
in the first group; ``members`` lists the ids of generation ``g`` by rank. Each survivor

1. posts ``alive/{id}`` with the ids it suspects and bumps ``change``, *then* destroys its
   process groups. A peer still waiting on it learns of the change from the store, in
   :meth:`Membership.wait`; closing the sockets is no signal to rely on: gloo closes them only
   once no ``Work`` of the group is referenced any more, not at ``destroy_process_group``,
   ``abort()`` or ``shutdown()`` (measured with torch 2.13);
2. waits until every member has posted, or every member that has not is suspected by one that
   has or is gone (its :mod:`~decent_optim.gossip.liveness` beacon refuses a connection: two
   workers lost at once are left out together), or twice the timeout has passed since it
   posted (a live member's own waits end within the timeout, and then it posts: silent after
   that, it is hung). A wait that a member left
   for the change goes on in its helper thread (:meth:`Membership.watch`); if it ends naming
   a peer (timed out, or closed), the member adds that peer to its post, so that a hung rank
   is left out when its neighbours' waits time out, not twice the timeout later;
3. proposes ``sorted(posted)`` with ``compare_set`` on ``decision``: the first proposal wins and
   every survivor reads that one, whatever it noticed itself. A member left out (it came too
   late) gets :class:`MembershipError`.

The new rank of id ``i`` is its index in the decision. A rebuild that fails (a member died after
posting, so the new group cannot connect within the timeout) is agreed again in the next
generation, where only posting counts: the members silent for the timeout, or gone, are left out.
Every wait is bounded by a multiple of ``timeout``.

Joining: a newcomer (``join=True``) takes an id above all earlier ones (``{prefix}/world`` plus a
counter: the last rank), posts ``join/{id}`` in the current generation (``{prefix}/generation``)
and bumps its ``change``, which the members read once per round (:meth:`Membership.pending`);
their agreement counts every posted ``join/``. Too late for a decision, it asks the next one.
"""

from __future__ import annotations

import datetime
import gc
import time
from collections.abc import Callable, Iterable

import torch.distributed as dist

from decent_optim.gossip import liveness, membership_store
from decent_optim.gossip.failures import GossipError
from decent_optim.gossip.membership_args import (
    built,
    check_arguments,
    check_place,
    check_suspects,
    warn_if_alone,
)
from decent_optim.gossip.membership_log import log_change
from decent_optim.gossip.view import View
from decent_optim.gossip.watch import Waits, waits

__all__ = ["Membership", "MembershipChanged", "MembershipError", "View"]


class MembershipError(GossipError):
    """This rank is not in the survivors' new group (declared dead), or they could not rebuild."""


class MembershipChanged(GossipError):
    """Another member started a change of membership: call :meth:`Membership.rebuild`."""


def _ids(text: str) -> set[int]:
    return {int(x) for x in text.split(",") if x}


def _text(ids: Iterable[int]) -> str:
    return ",".join(str(i) for i in sorted(ids))


class Membership:
    """The members of the default process group, and their agreement when some are lost.

    Built on every rank right after ``init_process_group`` (no communication). ``store`` must
    outlive any worker and be the same for every rank; ``prefix`` must be new to it (one per
    job). ``timeout`` (seconds or a ``timedelta``, finite, at least 0.1 s) bounds each wait of
    an agreement and the new group's, and the rounds of an optimizer given no ``timeout=``: set
    it to the optimizer's; it becomes the store's timeout too. ``join=True``: built instead in
    a process outside the group, which joins it at its first :meth:`rebuild` (the members'
    ``backend``; the store and prefix of the job). Warns when this process hosts the store or
    is a world of one; every change is logged (:mod:`~decent_optim.gossip.membership_log`).
    """

    def __init__(
        self,
        store: dist.Store,
        *,
        prefix: str = "decent_optim/live",
        timeout: float | datetime.timedelta = 60.0,
        poll: float | datetime.timedelta = 0.005,
        join: bool = False,
        backend: str = "gloo",
    ):
        timeout, poll = check_arguments(store, prefix, timeout, poll, join, backend)
        check_place(join, dist.is_initialized())
        self.store, self.prefix, self.timeout, self.poll = store, prefix, timeout, poll
        # the new group's rendezvous waits on the store with the store's own timeout
        store.set_timeout(datetime.timedelta(seconds=self.timeout))
        #: a newcomer until its first rebuild has connected it
        self.joining = join
        #: False while the store cannot be reached (membership_store: changes are paused)
        self.reachable, self.retry = True, 0.0
        # the waits watch() left for a change, and the peers they named (their late blame)
        self._waits = Waits(poll, MembershipChanged)
        membership_store.warn_if_hosted(store)
        if join:
            self.backend, self.me, self.view = backend, -1, View(-1, (), -1, ())
            return
        self.backend = dist.get_backend()
        world = dist.get_world_size()
        self.me = dist.get_rank()
        self.view = View(0, tuple(range(world)), self.me, ())
        store.compare_set(f"{prefix}/world", "", str(world))  # where newcomers' ids start
        self.beacon = liveness.post(store, f"{self.prefix}/beacon/{self.me}")
        warn_if_alone(world)

    def _key(self, generation: int, name: str) -> str:
        return f"{self.prefix}/g{generation}/{name}"

    def pending(self) -> bool:
        """Whether a member has started to agree on a change of the current generation, or a
        newcomer asks to join (one check of a store key)."""
        if not self.reachable and not membership_store.resume(self):
            return False
        try:
            return self.store.check([self._key(self.view.generation, "change")])
        except dist.DistNetworkError as err:  # gossip goes on without the store
            self.reachable = False
            membership_store.warn_paused(self.me, self.store, err)
            return False

    def wait(self, works: Iterable[dist.Work], timeout: float | None = None) -> None:
        """``work.wait()`` for each of ``works``, ended early by a change another member started.

        Raises:
            MembershipChanged: a member has started to agree on a change (rebuild, then redo).
            RuntimeError: the transport's error of a failed or timed-out work (its peer is a
                suspect).
        """
        self.watch(waits(works, timeout))

    def watch(self, wait: Callable[[], None]) -> None:
        """Run ``wait`` (a function that waits for transfers) and return or raise what it does,
        unless a member starts a change first: then raise :class:`MembershipChanged`.

        gloo's point-to-point ``Work.is_completed()`` stays False and a timed-out wait closes
        the connection, so ``wait`` runs in a helper thread while this one watches the store
        (checks spaced from 0.1 ms up to ``poll``: a quick exchange is not slowed down). After
        a change the helper is left to end with its transfers' error or timeout; it is not a
        daemon, because a gloo wait still running when the interpreter exits aborts the
        process ("terminate called without an active exception"): a process that ends right
        after a change waits for it, at most the transfers' timeout.
        """
        self._waits.run(wait, self.me, self.view.generation, self.pending)

    def rebuild(self, suspects: Iterable[int] = ()) -> View:
        """Agree with the other survivors on the members left, and rebuild the default group.

        ``suspects``: ranks of the current group this rank believes dead (may be empty, and may
        differ between survivors). Returns the new :class:`View`; the old default group and
        every group made from it are destroyed (rebuild such groups from the new one).

        Raises:
            MembershipError: this rank was left out, or no group could be rebuilt in time.
        """
        if not self.reachable:
            membership_store.resume(self, now=True)
        try:
            return self._join() if self.joining else self._rebuild(suspects)
        except dist.DistNetworkError as err:  # the store's connection, not a peer's
            what = "joining the job" if self.joining else "a change of membership"
            raise MembershipError(membership_store.lost(self.me, self.store, err, what)) from err

    def _rebuild(self, suspects: Iterable[int]) -> View:
        view = self.view
        ranks = check_suspects(suspects, view.world_size)
        suspected = {view.members[r] for r in ranks} - {self.me}
        return self._settle(view, self._agree(view, suspected, quick=True))

    def _settle(self, view: View, members: tuple[int, ...]) -> View:
        """Connect the generation after ``view`` among ``members``; agree again while it fails."""
        for _ in range(len(members) + 1):
            lost = tuple(sorted(set(self.view.members) - set(members)))
            view = View(view.generation + 1, members, members.index(self.me), lost)
            ready = liveness.ready(self.store, self._key(view.generation, "ready"), self, members)
            error = self._connect(view) if ready is None else MembershipError(ready)
            if error is None:
                log_change(self.view, view, self.me)
                self.view, self.joining = view, False
                self.store.set(f"{self.prefix}/generation", str(view.generation))
                built(self)
                return view
            # a member died during the rebuild: agree again, where only posting counts
            members = self._agree(view, set(), quick=False)
        raise MembershipError(
            f"[id {self.me}] could not rebuild the process group among {list(members)} "
            f"(generation {view.generation}): {error}"
        )

    def _join(self) -> View:
        """A newcomer's first rebuild: ask to join the current generation, wait for the members'
        decision, connect with them (the next generation if the decision came without it)."""
        store, wait = self.store, 3 * self.timeout  # a round, then an agreement of 2 timeouts
        if not store.check([f"{self.prefix}/world"]):
            raise MembershipError(
                f"no job runs with prefix={self.prefix!r} on this store (no member has built its "
                "Membership yet): start the newcomer once the members train, with their store"
            )
        world = int(store.get(f"{self.prefix}/world").decode())
        self.me = world + store.add(f"{self.prefix}/joined", 1) - 1
        self.beacon = liveness.post(store, f"{self.prefix}/beacon/{self.me}")
        key = f"{self.prefix}/generation"
        g = int(store.get(key).decode()) if store.check([key]) else 0
        for _ in range(64):
            store.set(self._key(g, f"join/{self.me}"), "")
            store.add(self._key(g, "change"), 1)
            deadline, decision = time.monotonic() + wait, self._key(g, "decision")
            members = _ids(store.get(self._key(g - 1, "decision")).decode()) if g else range(world)
            probe = time.monotonic() + 0.2  # every member's process gone: nobody will answer
            while not store.check([decision]):
                gone = time.monotonic() >= probe and liveness.every_one_gone(store, self, members)
                if gone or time.monotonic() >= deadline:
                    raise MembershipError(liveness.unanswered(self.me, g, wait, gone))
                probe = probe if time.monotonic() < probe else time.monotonic() + 0.2
                time.sleep(self.poll)
            decided = tuple(sorted(_ids(store.get(decision).decode())))
            if self.me in decided:
                return self._settle(View(g, (), -1, ()), decided)
            g += 1  # decided before this request was read: ask the next generation
        raise MembershipError(f"[id {self.me}] the members kept deciding without this newcomer")

    def _agree(self, view: View, suspected: set[int], *, quick: bool) -> tuple[int, ...]:
        store, g = self.store, view.generation
        store.set(self._key(g, f"alive/{self.me}"), _text(suspected))
        world = int(store.get(f"{self.prefix}/world").decode())
        store.add(self._key(g, "change"), 1)
        if dist.is_initialized():
            gc.collect()  # Works kept by reference cycles (tracebacks) would keep sockets open
            dist.destroy_process_group()
        decision_key = self._key(g, "decision")
        deadline = time.monotonic() + self.timeout * (2 if quick else 1)
        dead: set[int] = set()  # members whose process is gone (liveness: beacon refused)
        beacons, probe = f"{self.prefix}/beacon", time.monotonic()
        while True:
            if store.check([decision_key]):
                decided = _ids(store.get(decision_key).decode())
                break
            posted: dict[int, set[int]] = {}
            for i in view.members:
                key = self._key(g, f"alive/{i}")
                if store.check([key]):
                    posted[i] = _ids(store.get(key).decode())
            newcomers = range(world, world + store.add(f"{self.prefix}/joined", 0))
            for i in newcomers:  # they posted before they asked: none is waited for
                if i not in view.members and store.check([self._key(g, f"join/{i}")]):
                    posted[i] = set()
            silent = set(view.members) - set(posted)
            # who the others name (in a later generation only posting counts), and who is gone
            blamed = set().union(*posted.values()) if quick else set()
            if time.monotonic() >= probe:  # the silent ones nobody names: gone?
                dead |= liveness.dead(store, beacons, silent - blamed - dead)
                probe = time.monotonic() + 0.05
            late = self._waits.blamed(g, view.members) | dead
            if not late <= suspected | {self.me}:
                suspected = suspected | late - {self.me}
                store.set(self._key(g, f"alive/{self.me}"), _text(suspected))
                continue
            if not silent or silent <= blamed | dead or time.monotonic() >= deadline:
                proposal = _text(posted)
                won = store.compare_set(decision_key, "", proposal)
                decided = _ids(won.decode() if isinstance(won, bytes) else won)
                break
            time.sleep(self.poll)
        self._waits.forget(g)
        if self.me not in decided:
            raise MembershipError(
                f"[id {self.me}] the other members rebuilt their group without this rank "
                f"(generation {g + 1}: ids {sorted(decided)}); it reached the agreement after "
                "they had declared it dead (it was silent, or slower than the timeout). Leave "
                "the job, or join it again as a new member"
            )
        return tuple(sorted(decided))

    def _connect(self, view: View) -> Exception | None:
        try:
            dist.init_process_group(
                self.backend,
                store=dist.PrefixStore(self._key(view.generation, "pg"), self.store),
                rank=view.rank,
                world_size=view.world_size,
                timeout=datetime.timedelta(seconds=self.timeout),
            )
        except RuntimeError as exc:  # the store's and gloo's errors alike
            if dist.is_initialized():
                dist.destroy_process_group()
            return exc
        return None

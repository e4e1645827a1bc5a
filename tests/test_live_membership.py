"""Live membership (issue 42, the engine): survivors of a SIGKILLed rank rebuild in-process.

Four gloo ranks; the fault is injected, one rank SIGKILLs itself at a chosen point. The
survivors agree through a ``FileStore`` that outlives every worker (a file of the test's
folder), rebuild their group with :class:`decent_optim.gossip.membership.Membership`, then
complete an all-reduce and a ring exchange whose values are checked against the ids of the
survivors, and a few gossip rounds checked against a dense float64 mixing-matrix simulation.
Every wait is bounded (``TIMEOUT`` in the engine, the harness's timeout around it).
"""

from __future__ import annotations

import datetime
import os
import signal
import time

import pytest
import torch
from _harness import run_world_fresh

TIMEOUT = 3.0  # seconds: the engine's bound on each wait (a rebuild cut by a death: ~2x)
HUNG_TIMEOUT = 2.0  # the same where a rank hangs for 3x it: its test takes that long
PATIENT = 30.0  # seconds: the ring's waits (a failure is noticed by an error or the store)


def _membership(path, timeout=TIMEOUT):
    import torch.distributed as dist

    from decent_optim.gossip.membership import Membership

    store = dist.FileStore(os.path.join(path, "store"), -1)
    return Membership(store, prefix="live", timeout=timeout)


def _exchange(live, value, wait_s=PATIENT):
    """Send ``value`` to the right in the default group's ring, receive from the left.

    Returns ``(received, suspects)``: the peer of the wait that failed, if one did; none when
    another member started a change.
    """
    import torch.distributed as dist

    from decent_optim.gossip.membership import MembershipChanged

    rank, n = dist.get_rank(), dist.get_world_size()
    left, right = (rank - 1) % n, (rank + 1) % n
    got = torch.zeros(1)
    try:
        send = dist.isend(torch.tensor([float(value)]), right)
    except RuntimeError:
        return None, [right]
    try:  # posting fails too once gloo knows the pair closed
        recv = dist.irecv(got, left)
    except RuntimeError:
        return None, [left]
    for work, peer in ((recv, left), (send, right)):
        try:
            live.wait([work], timeout=wait_s)
        except MembershipChanged:
            return None, []
        except RuntimeError:
            return None, [peer]
    return got.item(), []


def _ring(live, me_id):
    """An all-reduce of the ids and a ring exchange of them, in the default group."""
    import torch.distributed as dist

    total = torch.tensor([float(me_id)])
    dist.all_reduce(total)
    got, suspects = _exchange(live, me_id)
    assert got is not None, suspects
    return total.item(), got


def _until_failure(live, victim, kill_at, idle=None):
    """Ring exchanges until one fails; the victim kills itself before step ``kill_at``.

    Returns the ranks suspected: the peer of the wait that failed.
    ``idle``: ``(rank, seconds)``, a rank that computes that long before step ``kill_at``.
    """
    import torch.distributed as dist

    me = dist.get_rank()
    for step in range(100):
        if step == kill_at and me == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == kill_at and idle is not None and me == idle[0]:
            time.sleep(idle[1])
        got, suspects = _exchange(live, me + step)
        if got is None:
            return suspects
        assert got == float((me - 1) % 4 + step), (got, step)
    raise AssertionError("no failure noticed in 100 steps")


def _gossip_rounds(rounds):
    """``rounds`` gossip rounds of the ring topology on the current default group, float64."""
    import torch.distributed as dist

    from decent_optim import topologies
    from decent_optim.gossip import Gossiper

    n, rank = dist.get_world_size(), dist.get_rank()
    gossiper = Gossiper(topologies.get("ring", n), timeout=datetime.timedelta(seconds=30))
    x = torch.arange(5, dtype=torch.float64) * (rank + 1) + 10 * rank
    for step in range(rounds):
        gossiper.start([x], step).wait_and_mix_()
    return x


def _kill_one(rank, world_size, path, victim, idle):
    live = _membership(path)
    suspects = _until_failure(live, victim, kill_at=3, idle=idle)
    view = live.rebuild(suspects)
    total, left = _ring(live, rank)
    return {
        "suspects": suspects,
        "view": tuple(view),
        "total": total,
        "left": left,
        "gossip": _gossip_rounds(4),
    }


def _expected_gossip(n, rounds):
    from decent_optim import topologies

    topo = topologies.get("ring", n)
    x = torch.stack([torch.arange(5, dtype=torch.float64) * (r + 1) + 10 * r for r in range(n)])
    for step in range(rounds):
        x = topo.mixing_matrix(step).to(torch.float64) @ x
    return x


def _check_survivors(results, victim):
    survivors = [r for r in range(4) if r != victim]
    assert results[victim] is None, results
    expected = _expected_gossip(3, 4)
    for new_rank, old in enumerate(survivors):
        out = results[old]
        generation, members, rank, lost = out["view"]
        assert (generation, members, rank, lost) == (1, tuple(survivors), new_rank, (victim,))
        assert out["total"] == float(sum(survivors)), out
        assert out["left"] == float(survivors[new_rank - 1]), out
        torch.testing.assert_close(out["gossip"], expected[new_rank], rtol=0, atol=1e-12)


@pytest.mark.multiprocess
def test_survivors_of_a_kill_rebuild_and_communicate(tmp_path):
    results = run_world_fresh(_kill_one, 4, str(tmp_path), 2, None, timeout=60, killed=(2,))
    _check_survivors(results, victim=2)


@pytest.mark.multiprocess
def test_survivors_that_notice_at_different_times_agree(tmp_path):
    # rank 0 computes for a while before the step in which 2 dies: 3 notices at once and
    # starts the change; rank 0 notices nothing itself, later, and learns it from the store
    results = run_world_fresh(_kill_one, 4, str(tmp_path), 2, (0, 1.0), timeout=60, killed=(2,))
    _check_survivors(results, victim=2)
    assert results[3]["suspects"] == [2], results[3]
    assert results[0]["suspects"] == [], results[0]


def _kill_during_rebuild(rank, world_size, path):
    from decent_optim.gossip.membership import Membership

    class DiesInRebuild(Membership):
        def _connect(self, view):
            if self.me == 3 and view.generation == 1:  # posted alive, never connects
                os.kill(os.getpid(), signal.SIGKILL)
            return super()._connect(view)

    live = _membership(path)
    live.__class__ = DiesInRebuild
    suspects = _until_failure(live, victim=2, kill_at=3)
    view = live.rebuild(suspects)
    total, left = _ring(live, rank)
    return tuple(view), total, left


@pytest.mark.multiprocess
def test_a_death_during_the_rebuild_is_agreed_again(tmp_path):
    results = run_world_fresh(_kill_during_rebuild, 4, str(tmp_path), timeout=60, killed=(2, 3))
    assert results[2] is None and results[3] is None, results
    for new_rank, old in enumerate((0, 1)):
        view, total, left = results[old]
        # generation 1 (0, 1, 3) could not connect; generation 2 leaves 3 out
        assert view == (2, (0, 1), new_rank, (2, 3)), view
        assert total == 1.0 and left == float(1 - old), results


def _hung(rank, world_size, path):
    from decent_optim.gossip.membership import MembershipError

    live = _membership(path, HUNG_TIMEOUT)
    # rank 2 is killed while rank 0 hangs for three timeouts; nobody suspects rank 0, but it
    # stays silent for more than twice the timeout: 1 and 3 go on without it, it learns later
    suspects = _until_failure(live, victim=2, kill_at=3, idle=(0, 3 * HUNG_TIMEOUT))
    try:
        view = live.rebuild(suspects)
    except MembershipError as err:
        return "left out", str(err)
    total, left = _ring(live, rank)
    return tuple(view), total, left


@pytest.mark.multiprocess
def test_a_member_silent_for_the_timeout_is_left_out_and_told(tmp_path):
    results = run_world_fresh(_hung, 4, str(tmp_path), timeout=60, killed=(2,))
    kind, message = results[0]
    assert kind == "left out", results[0]
    assert "rebuilt their group without this rank" in message and "ids [1, 3]" in message
    for new_rank, old in enumerate((1, 3)):
        view, total, left = results[old]
        assert view == (1, (1, 3), new_rank, (0, 2)), view
        assert total == 4.0 and left == float((1, 3)[1 - new_rank]), results


LATE_TIMEOUT = 60.0  # the agreement's wait for a silent member: this test must not need it
ROUND_TIMEOUT = 3.0  # the gossip's wait, after which the hung rank's neighbour blames it


def _hung_blamed_late(rank, world_size, path):
    import torch.distributed as dist

    from decent_optim import topologies
    from decent_optim.gossip import Gossiper
    from decent_optim.gossip.membership import MembershipChanged

    live = _membership(path, LATE_TIMEOUT)
    live.store.set(f"pid/{rank}", str(os.getpid()))
    gossiper = Gossiper(
        topologies.get("ring", world_size), timeout=datetime.timedelta(seconds=ROUND_TIMEOUT)
    )
    gossiper.watch = live.watch
    x = torch.full((4,), float(rank), dtype=torch.float64)
    dist.barrier()  # every rank started: a slow start must not time out the first round
    gossiper.start([x], 0).wait_and_mix_()  # a round that works
    dist.barrier()
    if rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)  # hung: killed by rank 1 once the others rebuilt
    if rank == 0:
        # the first to act blames a live member (as a non-neighbour whose wait timed out
        # first does): its neighbours leave their waits for the change before they time out
        time.sleep(0.5)
        view = live.rebuild([3])
    else:
        with pytest.raises(MembershipChanged):
            gossiper.start([x], 1).wait_and_mix_()
        view = live.rebuild([])  # the wait left behind still names the hung rank
    if rank == 1:
        os.kill(int(live.store.get("pid/2")), signal.SIGKILL)
    return tuple(view)


@pytest.mark.multiprocess
def test_a_hung_member_is_left_out_when_a_wait_left_for_the_change_times_out(tmp_path):
    # without the late blame the others would wait 2 x LATE_TIMEOUT for the silent rank 2,
    # past the harness's timeout
    results = run_world_fresh(_hung_blamed_late, 4, str(tmp_path), timeout=90, killed=(2,))
    assert results[2] is None
    for new_rank, old in enumerate((0, 1, 3)):
        assert results[old] == (1, (0, 1, 3), new_rank, (2,)), results

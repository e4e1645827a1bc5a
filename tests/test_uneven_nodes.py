"""``uneven=True`` with several ranks per node: one copy per node crosses the uplink, and no step
waits for a node-mate (the deferred node rounds of decent_optim.gossip.nodes).

Two emulated nodes of two ranks (``local_world_size=2``). The dense float64 reference is
tests/test_uneven.py's, with the topology's mixing matrices for two ranks per node; what crosses
between nodes is counted from the point-to-point sends (and the all-reduces) each rank posts.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _harness import run_world, run_world_fresh, wait_for_the_other_ranks
from _uneven import (
    SMALL_BUCKETS,
    build,
    run_in_time,
    run_uneven,
    save_or_resume,
    train_step,
    wait_for_round,
)
from test_optim_multiprocess import _model
from test_uneven import _reference
from torch import nn

import decent_optim as dopt
from decent_optim.gossip import Gossiper, GossipError
from decent_optim.topologies import get as get_topology

LOCAL = 2  # ranks per node: ranks 0, 1 on node 0, ranks 2, 3 on node 1


def _build(model, topology, local_steps, uneven=True, **extra):
    """build() on two ranks per node."""
    return build(model, local_steps, topology=topology, uneven=uneven, **_node(extra))


def _node(options):
    """More of build()'s options: two ranks per node, a timeout of 60 s unless given."""
    return {"local_world_size": LOCAL, "timeout": 60, **options}


# -- (a) the dense reference ------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.parametrize("topology", ["complete", "alternating-exp-ring"])
def test_matches_the_dense_reference_with_uneven_step_counts(topology):
    n, local_steps, budget = 4, 3, 24
    # a fast and a slow rank on each node
    options = _node(dict(topology=topology, bucket_cap_mb=SMALL_BUCKETS))
    runs = run_world(run_uneven, n, [0.0, 0.03, 0.004, 0.02], budget, local_steps, options)
    steps = [r[1] for r in runs]
    assert steps[0] > steps[1] + 2 * local_steps, f"the fast rank should step more: {steps}"
    assert len({r[4] for r in runs}) == 1, "every rank must stop at the same round"
    want = _reference(n, topology, local_steps, runs, local_world_size=LOCAL)
    got = torch.stack([r[0] for r in runs])
    assert not torch.allclose(got[0], got[1]), "ranks should differ: the test would be vacuous"
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)


# -- (b) what crosses the uplink --------------------------------------------------------------
class _Uplink:
    """Counts the bytes this rank sends to ranks of the other node: point-to-point sends of the
    parameters (small ones, of at most 64 bytes, are the step counts and checks), and
    all-reduces over groups that span nodes (their size, a lower bound of what they move)."""

    def __init__(self, rank: int) -> None:
        self.node, self.p2p, self.allreduced = rank // LOCAL, 0, []
        self._saved = dist.batch_isend_irecv, dist.all_reduce

    def __enter__(self) -> _Uplink:
        batch, all_reduce = self._saved

        def counted_batch(ops):
            for op in ops:
                size = op.tensor.numel() * op.tensor.element_size()
                if op.op is dist.isend and op.peer // LOCAL != self.node and size > 64:
                    self.p2p += size
            return batch(ops)

        def counted_all_reduce(tensor, *args, group=None, **kwargs):
            ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
            if len({r // LOCAL for r in ranks}) > 1:
                self.allreduced.append(tensor.numel() * tensor.element_size())
            return all_reduce(tensor, *args, group=group, **kwargs)

        dist.batch_isend_irecv, dist.all_reduce = counted_batch, counted_all_reduce
        return self

    def __exit__(self, *exc: object) -> None:
        dist.batch_isend_irecv, dist.all_reduce = self._saved


def _count(rank, n, compression, sleeps, budget):
    torch.manual_seed(7)
    model = nn.Linear(64, 64)  # 4160 float32 parameters in one bucket: two shards of an int8 copy
    opt = _build(model, "complete", 2, compression=compression, budget=budget)
    with _Uplink(rank) as uplink:
        t = 0
        while not opt.stopped:
            time.sleep(sleeps[rank])
            opt.zero_grad()
            model(
                torch.randn(8, 64, generator=torch.Generator().manual_seed(100 * t + rank))
            ).square().sum().backward()
            opt.step()
            t += 1
    return uplink.p2p, uplink.allreduced, opt.round  # rounds mixed


def _int8_bytes(numel: int) -> int:
    """An int8 payload: a byte per element, padded to whole chunks of 1024, and a float32 scale
    per chunk."""
    return (1024 + 4) * -(-numel // 1024)


@pytest.mark.multiprocess
@pytest.mark.parametrize("compression", [None, "int8"])
def test_one_copy_per_node_and_direction_crosses_the_uplink(compression):
    numel = 64 * 64 + 64
    runs = run_world(_count, 4, compression, [0.0, 0.01, 0.005, 0.0], 30)
    rounds = runs[0][2]
    assert rounds >= 3 and all(r[2] == rounds for r in runs)
    for rank, (_, allreduced, _) in enumerate(runs):
        # only small checks (the step counts, the gradient check) may be all-reduced across
        # nodes; a 4-rank all-reduce of the parameters moves 1.5 copies per direction
        assert all(size <= 64 for size in allreduced), (rank, allreduced)
    if compression is None:
        copy = [4 * numel] * rounds
    else:  # the first round sends exact values; later ones an int8 payload per shard
        half = 3 * 1024  # half the elements, in whole chunks of 1024
        copy = [4 * numel] + [_int8_bytes(half) + _int8_bytes(numel - half)] * (rounds - 1)
    for node in (0, 1):
        sent = sum(runs[r][0] for r in range(node * LOCAL, (node + 1) * LOCAL))
        assert sent == sum(copy), f"node {node} sent {sent / sum(copy):.2f} copies per round"


# -- (c) a slow node-mate ---------------------------------------------------------------------
def _slow_mate(rank, n, pause):
    """Rank 1 sleeps ``pause`` s before its fourth step, after its first launch (the first steps
    wait for a check of the gradients: tests/test_traps.py); the others step on. Returns the
    wall-clock times of the ranks' steps and of rank 1's pause."""
    torch.manual_seed(7)
    model = nn.Linear(16, 16)
    opt = _build(model, "complete", 2, dopt.Uneven(cap=None), budget=40)  # no cap: no wait
    ends, paused = [], None
    t = 0
    while not opt.stopped:
        if rank == 1 and t == 3:
            start = time.time()
            time.sleep(pause)
            paused = (start, time.time())
        else:
            time.sleep(0.002)
        opt.zero_grad()
        model(torch.randn(4, 16) + rank).square().sum().backward()
        opt.step()
        ends.append(time.time())
        t += 1
    return ends, paused


@pytest.mark.multiprocess
def test_a_slow_node_mate_does_not_slow_a_rank_down():
    runs = run_world(_slow_mate, 4, 3.0)
    start, end = runs[1][1]
    during = sum(start < t < end for t in runs[0][0])
    # a launch that waited for its node-mate would stop rank 0 at its second launch
    assert during >= 10, f"rank 0 took {during} steps while its node-mate slept"


def _mate_stops(rank, n):
    """Rank 1 stops calling step() after 3 steps (alive, silent); the others step on."""
    model = _model()
    opt = _build(model, "complete", 2, timeout=3)
    started = time.monotonic()
    try:
        for t in range(400 if rank != 1 else 3):
            train_step(model, opt, rank, t)
            time.sleep(0.01)
    except GossipError as err:
        return "raised", time.monotonic() - started, str(err)
    if rank == 1:
        wait_for_the_other_ranks()  # alive and silent until the others gave up
    return "finished", time.monotonic() - started, ""


@pytest.mark.multiprocess
def test_a_node_mate_that_stops_stepping_raises_within_the_timeout():
    runs = run_world_fresh(_mate_stops, 4)
    what, seconds, message = runs[0]
    assert what == "raised", "rank 0 kept training without its node-mate"
    assert seconds < 3 + 5, seconds
    # its wait for the exchange inside the node names the node-mate
    assert "round 2" in message and "peer(s) [1]" in message, message


# -- the exchange itself: deferred rounds are the step-locked rounds' bits ---------------------
def _rounds(rank, n, topology, compression, dtype):
    """Eight rounds of the same values, step-locked and deferred (each deferred wait in a thread
    while the main thread gossips with another slot on the same group)."""
    topo = get_topology(topology, n, LOCAL)
    gen = torch.Generator().manual_seed(rank)
    start = [torch.randn(3000, generator=gen).to(dtype), torch.randn(7, generator=gen).to(dtype)]
    results = []
    for deferred in (False, True):
        gossip = Gossiper(topo, compression=compression, deferred=deferred)
        other = Gossiper(topo, slot=1, deferred=True)  # its own tags: messages never mixed up
        bufs, extra = [b.clone() for b in start], [b.clone() * 2 for b in start]
        history = []
        for step in range(1, 9):
            handle = gossip.start(bufs, step)
            waiter = threading.Thread(target=handle.wait)
            waiter.start()
            if deferred:
                for _ in range(2):
                    o = other.start(extra, step)
                    o.wait()
                    o.mix_()
            waiter.join()
            handle.mix_()
            history.append(torch.cat(bufs).clone())
        results.append(torch.stack(history))
        if deferred:
            results.append(torch.cat(extra))
    return results


@pytest.mark.multiprocess
@pytest.mark.parametrize("compression", [None, "int8"])
@pytest.mark.parametrize("topology", ["complete", "alternating-exp-ring"])
def test_deferred_rounds_give_the_step_locked_bits(topology, compression):
    runs = run_world(_rounds, 4, topology, compression, torch.float64)
    for locked, deferred, _ in runs:
        assert torch.equal(locked, deferred)
    # the other slot's rounds, run meanwhile, are the group means as well: 16 rounds in all
    topo = get_topology(topology, 4, LOCAL)
    x = torch.stack([torch.cat(_start(r)) * 2 for r in range(4)])
    for step in range(1, 9):
        x = topo.mixing_matrix(step).double() @ x
        x = topo.mixing_matrix(step).double() @ x
    torch.testing.assert_close(torch.stack([r[2] for r in runs]), x, rtol=0, atol=1e-9)
    if compression is None:
        x = torch.stack([torch.cat(_start(r)) for r in range(4)])
        for step in range(1, 9):
            x = topo.mixing_matrix(step).double() @ x
        torch.testing.assert_close(torch.stack([r[1][-1] for r in runs]), x, rtol=0, atol=1e-12)


def _start(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    return [torch.randn(3000, generator=gen).double(), torch.randn(7, generator=gen).double()]


def _even(uneven, compression):
    """Even ranks, each round given time to arrive before the next step (run_in_time's
    options, on two ranks per node)."""
    return dict(
        topology="complete",
        uneven=uneven,
        compression=compression,
        local_world_size=LOCAL,
        bucket_cap_mb=SMALL_BUCKETS,
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("compression", [None, "int8"])
def test_rounds_that_arrive_in_time_give_step_locked_node_rounds_bit_for_bit(compression):
    plain = run_world(run_in_time, 4, 14, _even(False, compression))
    uneven = run_world(run_in_time, 4, 14, _even(True, compression))
    for a, b in zip(plain, uneven):
        assert torch.equal(a, b)
    assert not torch.equal(plain[0], plain[1])


def _resume(rank, n, folder, save_at, steps, resume):
    """int8 on two ranks per node, rounds in time (as _even); the uninterrupted run saves after
    ``save_at`` steps (a round in flight), the resumed one starts from that file."""
    model = _model()
    opt = _build(model, "complete", 3, compression="int8", bucket_cap_mb=SMALL_BUCKETS)
    path = Path(folder, f"rank{rank}.pt")
    # saved after the deferred steps ran, before the mix
    return save_or_resume(rank, model, opt, path, save_at, steps, resume, wait_for_round)


@pytest.mark.multiprocess
@pytest.mark.parametrize("save_at", [7, 8])  # a round in flight, one and two steps after its launch
def test_int8_resumes_bit_for_bit_with_a_deferred_round_in_flight(save_at, tmp_path):
    straight = run_world(_resume, 4, str(tmp_path), save_at, 16, False)
    resumed = run_world(_resume, 4, str(tmp_path), save_at, 16, True)
    assert not torch.equal(straight[0], straight[1]), "the ranks should differ"
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)

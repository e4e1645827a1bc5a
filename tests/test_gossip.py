"""The gossip engine on gloo ranks: mixing alone, transports, timing of the mix, start-up checks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_world
from torch import nn

import decent_optim as dopt
from decent_optim.gossip import Gossiper
from decent_optim.topologies import CustomTopology
from decent_optim.topologies import get as get_topology

ROUNDS = 12


def _distinct_values(rank: int, numel: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(77 + rank)
    return torch.randn(numel, generator=gen, dtype=torch.float64) * (rank + 1)


def _gossip_only(rank, world_size, topology, local, rounds):
    """lr = 0: steps only mix. Returns the parameters after every step and after synchronize."""
    params = [
        nn.Parameter(torch.zeros(5, dtype=torch.float64)),
        nn.Parameter(torch.zeros(2, 3, dtype=torch.float64)),
    ]
    opt = dopt.DSGD(
        params, lr=0.0, topology=topology, local_world_size=local, bucket_cap_mb=40 / 2**20
    )
    with torch.no_grad():  # give every rank its own values after the start-up broadcast
        values = _distinct_values(rank, 11)
        params[0].copy_(values[:5])
        params[1].copy_(values[5:].view(2, 3))
    history = []
    for _ in range(rounds):
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        history.append(nn.utils.parameters_to_vector(params).detach().clone())
    opt.synchronize()
    history.append(nn.utils.parameters_to_vector(params).detach().clone())
    return torch.stack(history)


GOSSIP_TOPOLOGIES = [
    ("ring", 3, 1),
    ("ring", 4, 1),
    ("one-peer-exp", 8, 1),
    ("complete", 4, 1),
    ("alternating-exp-ring", 4, 2),
    ("alternating-exp-ring", 8, 2),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("topology, n, local", GOSSIP_TOPOLOGIES, ids=str)
def test_gossip_alone_preserves_mean_and_shrinks_consensus_distance(topology, n, local):
    hist = torch.stack(
        run_world(_gossip_only, n, topology, local, ROUNDS), dim=1
    )  # (time, rank, d)
    x0 = torch.stack([_distinct_values(r, 11) for r in range(n)])
    mean0 = x0.mean(dim=0)
    topo = get_topology(topology, n, local)

    # the values after step k are X(k) = W(k-1)...W(1) X0 (round 0 is skipped: ranks were
    # identical at construction); after synchronize the last round is mixed in too
    expected, x = [], x0
    for k in range(1, ROUNDS + 2):
        if k >= 2:
            x = topo.mixing_matrix(k - 1) @ x
        expected.append(x)
    torch.testing.assert_close(hist, torch.stack(expected))

    for x in hist:
        torch.testing.assert_close(x.mean(dim=0), mean0, rtol=0, atol=1e-6)
    distance = [(x - mean0).norm().item() for x in hist]
    period = topo.period
    # after step 1 nothing has mixed yet; from then on each full period strictly contracts,
    # until exact consensus (ring of 4 and one-peer-exp average exactly within a period)
    for k in range(1, len(distance) - period):
        assert distance[k + period] < distance[k] or distance[k] < 1e-12, (k, distance)
    assert distance[-1] < 0.5 * distance[0]


def _custom_round_trip(rank, world_size, schedule, transport, rounds):
    topo = CustomTopology(schedule) if schedule is not None else get_topology("ring", world_size)
    gossip = Gossiper(topo, transport=transport)
    bufs = [_distinct_values(rank, 6), _distinct_values(rank + 10, 3).float()]
    for t in range(rounds):
        gossip.start(bufs, t).wait_and_mix_()
    return [b.clone() for b in bufs]


# a non-uniform, doubly stochastic schedule: lazy Metropolis weights on a path 0-1-2-3,
# then a round with a 3-cycle of weight 1/3 and a self-loop
METROPOLIS = [
    [
        [2 / 3, 1 / 3, 0, 0],
        [1 / 3, 1 / 3, 1 / 3, 0],
        [0, 1 / 3, 1 / 3, 1 / 3],
        [0, 0, 1 / 3, 2 / 3],
    ],
    [[0.5, 0.25, 0.25, 0], [0.25, 0.5, 0.25, 0], [0.25, 0.25, 0.5, 0], [0, 0, 0, 1]],
]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "schedule, transport",
    [(METROPOLIS, "p2p"), (METROPOLIS, "auto"), (None, "p2p"), (None, "allreduce")],
    ids=["custom-p2p", "custom-auto", "ring-p2p", "ring-allreduce"],
)
def test_gossiper_mixes_with_arbitrary_weights(schedule, transport):
    n = 4
    got = run_world(_custom_round_trip, n, schedule, transport, 5)
    topo = CustomTopology(schedule) if schedule is not None else get_topology("ring", n)
    for b, (seed_shift, dtype) in enumerate([(0, torch.float64), (10, torch.float32)]):
        x = torch.stack([_distinct_values(r + seed_shift, 6 if b == 0 else 3) for r in range(n)])
        x = x.to(dtype).double()
        for t in range(5):
            x = topo.mixing_matrix(t) @ x
        torch.testing.assert_close(
            torch.stack([g[b] for g in got]).double(),
            x,
            rtol=1e-6 if dtype == torch.float32 else 1e-12,
            atol=1e-6,
        )


def _build(rank, world_size, topology, shape_by_rank):
    shape = shape_by_rank[rank] if shape_by_rank else (3,)
    p = nn.Parameter(torch.randn(shape))
    try:
        dopt.DecentralizedAdamW([p], topology=topology)
    except Exception as err:  # report, so the parent can check every rank raised the same
        return f"{type(err).__name__}: {err}"
    return "built"


@pytest.mark.multiprocess
def test_topology_that_does_not_fit_the_world_size():
    got = run_world(_build, 3, "one-peer-exp", None)
    assert all(
        g.startswith("ValueError: one-peer-exp needs a power-of-two world size") for g in got
    ), got
    assert all("got 3" in g for g in got)


@pytest.mark.multiprocess
def test_ranks_with_different_parameter_shapes_fail_at_construction():
    got = run_world(_build, 3, "ring", {0: (3,), 1: (3,), 2: (4,)})
    for g in got:  # every rank raises, none is left waiting in a later round
        assert g.startswith("AgreementError: building DecentralizedAdamW: the ranks disagree"), got
        assert "ranks 0, 1: shape (3,)" in g and "rank 2: shape (4,)" in g


@pytest.mark.multiprocess
def test_same_sizes_but_different_shapes_are_caught_too():
    got = run_world(_build, 2, "ring", {0: (2, 3), 1: (3, 2)})
    assert all("rank 0: shape (2, 3)" in g and "rank 1: shape (3, 2)" in g for g in got), got


def _start_identical(rank, world_size):
    torch.manual_seed(rank)  # a different initialisation on every rank
    model = nn.Linear(4, 3)
    dopt.DecentralizedAdam(model.parameters(), topology="complete")
    out = nn.utils.parameters_to_vector(model.parameters()).detach()
    everyone = [torch.empty_like(out) for _ in range(world_size)]
    dist.all_gather(everyone, out)
    torch.manual_seed(0)
    rank0 = nn.utils.parameters_to_vector(nn.Linear(4, 3).parameters()).detach()
    return [torch.equal(e, rank0) for e in everyone]


@pytest.mark.multiprocess
def test_ranks_start_from_rank_zero_parameters():
    assert all(all(row) for row in run_world(_start_identical, 3))


def _resized_buffers(rank, world_size):
    gossip = Gossiper(get_topology("ring", world_size))
    out = []
    for numel in (6, 9, 4):  # receive buffers must follow the sizes of the buffers sent
        buf = torch.full((numel,), float(rank), dtype=torch.float64)
        gossip.start([buf], 0).wait_and_mix_()
        out.append(buf)
    return out


@pytest.mark.multiprocess
def test_gossiper_follows_changing_buffer_sizes():
    got = run_world(_resized_buffers, 2)
    for per_rank in got:
        for buf in per_rank:
            torch.testing.assert_close(buf, torch.full_like(buf, 0.5))


def _unscaled_round(rank, world_size, schedule, transport, t):
    topo = CustomTopology(schedule) if schedule is not None else get_topology("ring", world_size)
    gossip = Gossiper(topo, transport=transport)
    bufs = [_distinct_values(rank, 6), _distinct_values(rank + 10, 3).float()]
    factors = gossip.start(bufs, t).wait_and_mix_unscaled_()
    return factors, [b.clone() for b in bufs]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "schedule, transport, t",
    [(METROPOLIS, "p2p", 0), (METROPOLIS, "p2p", 1), (None, "p2p", 0), (None, "allreduce", 1)],
    ids=["custom-round0", "custom-round1", "ring-pairs", "ring-allreduce"],
)
def test_unscaled_mix_leaves_the_sum_and_the_equal_weight(schedule, transport, t):
    # where a rank weighs all its sources equally, p2p leaves their plain sum and returns the
    # weight; otherwise (and after an all-reduce, which scales while copying) the factor is 1
    n = 4
    got = run_world(_unscaled_round, n, schedule, transport, t)
    topo = CustomTopology(schedule) if schedule is not None else get_topology("ring", n)
    w = topo.mixing_matrix(t)
    for rank, (factors, bufs) in enumerate(got):
        weights = {float(v) for v in w[rank] if v > 0}
        equal = transport == "p2p" and len(weights) == 1
        assert factors == [weights.pop() if equal else 1.0] * 2, (rank, factors)
        for b, seed_shift in enumerate([0, 10]):
            x = torch.stack(
                [_distinct_values(r + seed_shift, 6 if b == 0 else 3) for r in range(n)]
            )
            if b == 1:
                x = x.float().double()
            torch.testing.assert_close(
                bufs[b].double() * factors[b], (w @ x)[rank], rtol=1e-6, atol=1e-6
            )


def _posting_order(rank, world_size):
    gossip = Gossiper(CustomTopology(METROPOLIS))
    posted = []
    original = dist.batch_isend_irecv

    def record(ops):
        posted.append(["recv" if op.op is dist.irecv else "send" for op in ops])
        return original(ops)

    dist.batch_isend_irecv = record
    try:
        for t in range(2):
            bufs = [_distinct_values(rank, 6), _distinct_values(rank, 4)]
            gossip.start(bufs, t).wait_and_mix_()
    finally:
        dist.batch_isend_irecv = original
    return posted


@pytest.mark.multiprocess
def test_every_receive_is_posted_before_any_send():
    # gloo's transfers are rendezvous: a send moves data once the peer's "ready to receive"
    # notice arrived, and notices share the TCP stream with data. A rank that posted a send
    # first, to a peer already waiting, queued its whole buffer ahead of its own notice, so its
    # peer could not start sending back until that buffer had crossed the link: the round took
    # two transfer times instead of one on a slow link (ring, 100 Mbit: 1038 -> 732 ms/iter)
    for per_rank in run_world(_posting_order, 4):
        assert per_rank, "no point-to-point round was posted"
        for kinds in per_rank:
            assert "send" in kinds and "recv" in kinds, kinds
            first_send = kinds.index("send")
            assert "recv" not in kinds[first_send:], kinds


def _deferred_round(rank, world_size, schedule, transport, t):
    topo = CustomTopology(schedule) if schedule is not None else get_topology("ring", world_size)
    gossip = Gossiper(topo, transport=transport)
    bufs = [_distinct_values(rank, 6), _distinct_values(rank + 10, 3).float()]
    pending = gossip.start(bufs, t).wait_and_mix_deferred_()
    # an idle receive buffer would be the addend itself: none may be lent while one is pending
    addends = [None if p.addend is None else p.addend.clone() for p in pending]
    for buf, p in zip(bufs, pending):
        p.apply_(buf)
    return [p.factor for p in pending], addends, [b.clone() for b in bufs]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "schedule, transport, t, deferred",
    [(None, "p2p", 0, True), (None, "allreduce", 0, False), (METROPOLIS, "p2p", 0, False)],
    ids=["ring-pairs", "ring-allreduce", "custom-weights"],
)
def test_deferred_mix_leaves_a_pair_peer_values_to_the_caller(schedule, transport, t, deferred):
    # a pair round (point to point) hands back the peer's values and the weight 1/2 untouched,
    # so the optimizer can add and scale inside its own update; any other round mixes fully
    n = 4
    got = run_world(_deferred_round, n, schedule, transport, t)
    topo = CustomTopology(schedule) if schedule is not None else get_topology("ring", n)
    w = topo.mixing_matrix(t)
    for rank, (factors, addends, bufs) in enumerate(got):
        if deferred:
            peer = next(j for j in range(n) if j != rank and w[rank, j] > 0)
            assert factors == [0.5, 0.5]
            torch.testing.assert_close(addends[0], _distinct_values(peer, 6), rtol=0, atol=0)
        else:
            assert addends == [None, None]
        for b, seed_shift in enumerate([0, 10]):
            x = torch.stack(
                [_distinct_values(r + seed_shift, 6 if b == 0 else 3) for r in range(n)]
            )
            if b == 1:
                x = x.float().double()
            torch.testing.assert_close(bufs[b].double(), (w @ x)[rank], rtol=1e-6, atol=1e-6)

"""The runtime model on synthetic inputs; every expected value below is worked out by hand."""

import math

import pytest

from decent_optim import runtime
from decent_optim.runtime import Workload
from decent_optim.topologies import get

MB = 1e6


# -- expected maximum of normals ----------------------------------------------------------------
def test_expected_max_of_small_samples_matches_closed_forms():
    # E[max(Z1, Z2)] = E|Z1 - Z2| / 2 = sqrt(2) * sqrt(2/pi) / 2 = 1/sqrt(pi);
    # E[max of 3] = 3 / (2 sqrt(pi)) (classical result for the normal order statistics)
    assert runtime.expected_max_normal(1) == 0.0
    assert runtime.expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-9)
    assert runtime.expected_max_normal(3) == pytest.approx(3 / (2 * math.sqrt(math.pi)), abs=1e-9)


def test_expected_max_grows_with_the_number_of_workers_but_slowly():
    values = [runtime.expected_max_normal(k) for k in (1, 2, 4, 8, 16, 64, 256)]
    assert all(a < b for a, b in zip(values, values[1:]))
    # it grows like sqrt(2 ln k): below that bound for every k
    assert all(v < math.sqrt(2 * math.log(k)) for v, k in zip(values[1:], (2, 4, 8, 16, 64, 256)))


@pytest.mark.parametrize("k", [0, -1, 2.0])
def test_expected_max_rejects_bad_counts(k):
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        runtime.expected_max_normal(k)


# -- rates --------------------------------------------------------------------------------------
def test_parse_rate_understands_tc_units():
    assert runtime.parse_rate("1gbit") == pytest.approx(125e6)
    assert runtime.parse_rate("100mbit") == pytest.approx(12.5e6)
    assert runtime.parse_rate("2.5Gbps") == pytest.approx(2.5e9)
    assert runtime.parse_rate(42.0) == 42.0
    for bad in ("fast", "mbit", "-1gbit", 0):
        with pytest.raises(ValueError, match="rate must"):
            runtime.parse_rate(bad)


# -- communication from bandwidths --------------------------------------------------------------
# 4 workers on 2 nodes (ranks 0,1 | 2,3); 1 MB messages; 10 MB/s inside a node, 1 MB/s uplink
LINK = dict(nbytes=1 * MB, intra_bw=10 * MB, inter_bw=1 * MB)


def test_allreduce_time_of_a_ring_over_two_nodes():
    # each worker sends 2 * 3/4 of the message; one hop of the ring leaves each node: 1.5 s
    assert runtime.allreduce_time(world_size=4, local_world_size=2, **LINK) == pytest.approx(1.5)
    # all on one node: the same volume at the intra-node rate
    assert runtime.allreduce_time(world_size=4, local_world_size=4, **LINK) == pytest.approx(0.15)
    assert runtime.allreduce_time(world_size=1, local_world_size=1, **LINK) == 0.0
    # latency: 2 (n - 1) = 6 messages
    t = runtime.allreduce_time(world_size=4, local_world_size=2, latency=0.01, **LINK)
    assert t == pytest.approx(1.56)


def test_ring_rounds_alternate_between_cheap_and_cross_node():
    # even round pairs (0,1),(2,3): inside the nodes, 0.1 s; odd round pairs (1,2),(3,0): both
    # cross, so each uplink carries two messages: 2 s
    times = runtime.gossip_round_times(get("ring", 4, 2), **LINK)
    assert times == pytest.approx([0.1, 2.0])


def test_one_peer_exp_second_round_loads_the_uplink_with_every_worker():
    # round 0: partner i^1 (same node), round 1: partner i^2 (other node, two flows per uplink)
    times = runtime.gossip_round_times(get("one-peer-exp", 4, 2), **LINK)
    assert times == pytest.approx([0.1, 2.0])


def test_complete_averages_by_node_one_copy_per_direction():
    # the group of 4 on two nodes of 2: each worker sends its half (0.5 MB) across, so each
    # uplink carries 1 MB: 1 s (a ring all-reduce would carry 1.5 MB); inside a node each worker
    # moves 0.5 MB before and 0.5 MB after: 0.1 s
    times = runtime.gossip_round_times(get("complete", 4, 2), **LINK)
    assert times == pytest.approx([1.0])


def test_alternating_exp_ring_has_one_intra_and_one_inter_round():
    times = runtime.gossip_round_times(get("alternating-exp-ring", 4, 2), **LINK)
    assert sorted(times) == pytest.approx([0.1, 1.0])


# 1 MB of float32 = 250k elements: bf16 500 kB, int8 250k bytes + 245 scales of 4 bytes
INT8_MB = 250_000 * (1 + 4 / 1024) / MB


@pytest.mark.parametrize("compression, wire", [("bf16", 0.5), ("int8", INT8_MB)])
def test_compression_shrinks_what_crosses_nodes(compression, wire):
    link = dict(LINK, compression=compression)
    # complete: each uplink carries two half-shards of the compressed copy; inside a node the
    # part's mean and gather stay float32 (0.1 s)
    assert runtime.gossip_round_times(get("complete", 4, 2), **link) == pytest.approx(
        [max(wire, 0.1)]
    )
    # ring: the pairs inside a node stay exact (0.1 s); across, each uplink carries two payloads
    assert runtime.gossip_round_times(get("ring", 4, 2), **link) == pytest.approx([0.1, 2 * wire])
    assert runtime.wire_bytes(4e6, compression) == pytest.approx(4 * wire * MB)


def test_wire_bytes_agree_with_the_codecs_and_reject_unknown_names():
    from decent_optim.gossip import codecs

    for name, per_element in runtime.WIRE_BYTES.items():
        assert codecs.get(name).bytes_per_element == per_element
    assert runtime.wire_bytes(8.0, None) == 8.0
    with pytest.raises(ValueError, match="compression must be None or one of"):
        runtime.wire_bytes(8.0, "fp8")


@pytest.mark.parametrize("name", ["ring", "one-peer-exp", "complete", "alternating-exp-ring"])
def test_communication_time_falls_as_bandwidth_rises(name):
    topo = get(name, 8, 2)
    previous = None
    for rate in (1, 2, 5, 10, 100):
        link = dict(nbytes=MB, intra_bw=10 * MB, inter_bw=rate * MB)
        total = sum(runtime.gossip_round_times(topo, **link))
        ar = runtime.allreduce_time(world_size=8, local_world_size=2, **link)
        if previous is not None:
            assert total <= previous[0] and ar < previous[1]
        previous = (total, ar)


def test_round_degrees():
    assert runtime.round_degrees(get("ring", 4)) == [1, 1]
    assert runtime.round_degrees(get("complete", 4)) == [3]
    assert runtime.round_degrees(get("ring", 3)) == [1, 1]  # the worker sitting out has 0


# -- predictions --------------------------------------------------------------------------------
def test_no_variance_and_no_communication_gives_the_compute_time():
    w = Workload(compute_mean=0.2)
    assert runtime.predict_allreduce(w, 8, 0.0).iteration == pytest.approx(0.2)
    p = runtime.predict_gossip(w, [0.0, 0.0], [1, 1])
    assert p.iteration == pytest.approx(0.2)
    assert p.overlap_efficiency == pytest.approx(1.0)


def test_update_time_adds_to_every_method():
    w = Workload(compute_mean=0.2, update_time=0.05)
    assert runtime.predict_allreduce(w, 4, 0.0).iteration == pytest.approx(0.25)
    assert runtime.predict_gossip(w, [0.1], [1]).iteration == pytest.approx(0.25)


def test_gossip_shorter_than_compute_is_hidden():
    w = Workload(compute_mean=1.0)
    p = runtime.predict_gossip(w, [0.9, 0.3], [1, 1])
    assert p.iteration == pytest.approx(1.0)
    assert p.exposed_comm == 0.0


def test_communication_bound_regime():
    # compute 1 s, backward 2/3 of it; all-reduce 10 s of which at most the 2/3 s of backward
    # hides: 1 + 10 - 2/3; gossip rounds of 10 s and 4 s: mean of 10 and max(1, 4) = 7
    w = Workload(compute_mean=1.0)
    ar = runtime.predict_allreduce(w, 4, 10.0, overlap=1.0)
    assert ar.iteration == pytest.approx(1 + 10 - 2 / 3)
    assert runtime.predict_allreduce(w, 4, 10.0, overlap=0.0).iteration == pytest.approx(11.0)
    g = runtime.predict_gossip(w, [10.0, 4.0], [1, 1])
    assert g.iteration == pytest.approx(7.0)
    assert g.overlap_efficiency == pytest.approx(1.0)  # max(1, mean comm 7) / 7
    # half-overlapped all-reduce of 1 s: 0.5 s hide (less than the 2/3 s backward)
    assert runtime.predict_allreduce(w, 4, 1.0, overlap=0.5).iteration == pytest.approx(1.5)


def test_stragglers_hurt_all_reduce_more_than_gossip():
    # sigma = 0.1: all-reduce waits for the slowest of 4, a ring worker for the slowest of itself
    # and its one partner: 1 + 0.1 e_4 vs 1 + 0.1 / sqrt(pi)
    w = Workload(compute_mean=1.0, compute_std=0.1)
    ar = runtime.predict_allreduce(w, 4, 0.0)
    ring = runtime.predict_gossip(w, [0.0, 0.0], [1, 1])
    assert ring.iteration == pytest.approx(1 + 0.1 / math.sqrt(math.pi), abs=1e-9)
    assert ar.iteration > ring.iteration
    # more workers: all-reduce slows down, the ring does not
    assert runtime.predict_allreduce(w, 64, 0.0).iteration > ar.iteration


def test_recommend_orders_by_time_and_reports_speedup():
    w = Workload(compute_mean=1.0)
    rows = runtime.recommend(
        w, 4, 3.0, {"ring": ([0.5, 2.0], [1, 1]), "complete": ([3.0], [3])}, overlap=0.0
    )
    names = [p.method for p, _ in rows]
    # all-reduce 4 s; ring mean(max(1, .5), max(1, 2)) = 1.5 s; complete max(1, 3) = 3 s
    assert names == ["ring", "complete", "all-reduce"]
    assert [s for _, s in rows] == pytest.approx([4 / 1.5, 4 / 3, 1.0])


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="compute_mean must be a finite number >= 0"):
        Workload(compute_mean=-1.0)
    with pytest.raises(ValueError, match="backward_fraction must be in"):
        Workload(compute_mean=1.0, backward_fraction=2.0)
    with pytest.raises(ValueError, match="overlap must be in"):
        runtime.predict_allreduce(Workload(1.0), 4, 1.0, overlap=1.5)
    with pytest.raises(ValueError, match="equal length"):
        runtime.predict_gossip(Workload(1.0), [1.0], [1, 1])
    with pytest.raises(ValueError, match="bandwidths must be > 0"):
        runtime.allreduce_time(1.0, 4, 2, intra_bw=0.0, inter_bw=1.0)


def test_runtime_does_not_import_torch_distributed():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(runtime))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(m and m.split(".")[0] == "torch" for m in imported)


def test_overlap_efficiency_is_one_when_hidden_and_half_when_serialised():
    w = Workload(compute_mean=1.0, backward_fraction=0.5)
    assert runtime.predict_gossip(w, [1.0], [1]).overlap_efficiency == pytest.approx(1.0)
    # no overlap at all: compute 1 s then all-reduce 1 s, bound by max(1, 1) = 1 s
    ar = runtime.predict_allreduce(w, 4, 1.0, overlap=0.0)
    assert ar.overlap_efficiency == pytest.approx(0.5)

"""Tests for decent_optim.topologies: the W(t) schedules every rank computes without talking.

The expectations here come from the spec (docs: algorithms.md, "Topologies"), written out by hand
or by the small reference `_spec_groups` below, never from the code under test.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import decent_optim
from decent_optim import topologies
from decent_optim.topologies import (
    AlternatingExpRingTopology,
    CompleteTopology,
    CustomTopology,
    OnePeerExpTopology,
    RingTopology,
    Topology,
)

MAX_WORLD_SIZE = 64
# Sums of at most 64 float64 terms of size <= 1: exact up to a few ulps.
SUM_ATOL = 1e-12

NAMES = {
    "complete": CompleteTopology,
    "ring": RingTopology,
    "one-peer-exp": OnePeerExpTopology,
    "alternating-exp-ring": AlternatingExpRingTopology,
}


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _named_cases() -> list[tuple[str, int, int]]:
    """(name, world_size, local_world_size) for every size in 1..64 the spec accepts."""
    cases = [("complete", n, 1) for n in range(1, MAX_WORLD_SIZE + 1)]
    cases += [("ring", n, 1) for n in range(1, MAX_WORLD_SIZE + 1)]
    cases += [("one-peer-exp", n, 1) for n in range(1, MAX_WORLD_SIZE + 1) if _is_power_of_two(n)]
    cases += [("alternating-exp-ring", 1, 1)]
    for local in (1, 2, 4):
        nodes = 2
        while nodes * local <= MAX_WORLD_SIZE:
            cases.append(("alternating-exp-ring", nodes * local, local))
            nodes *= 2
    # The non-default local_world_size is accepted by the other names too (it only matters to AER).
    cases += [("complete", 8, 2), ("ring", 8, 4), ("one-peer-exp", 8, 2)]
    return cases


# One table drives the invariant tests.
CASES = _named_cases()
CASE_IDS = [f"{name}-n{n}-L{local}" for name, n, local in CASES]
# The sparse schedules at every size; complete (dense, slow to build) at a few.
PRODUCT_CASES = [c for c in CASES if c[0] != "complete" or c[1] in (1, 2, 3, 5, 8, 33, 64)]
PRODUCT_IDS = [f"{name}-n{n}-L{local}" for name, n, local in PRODUCT_CASES]


def _make(name: str, n: int, local: int = 1) -> Topology:
    return NAMES[name](n, local_world_size=local)


# ---------------------------------------------------------------------------------------------
# Reference written from the spec.


def _spec_period(name: str, n: int, local: int) -> int | None:
    """Period fixed by the spec; None where the spec leaves it open (AER at world size 1)."""
    if name == "complete":
        return 1
    if name == "ring":
        return 1 if n == 1 else 2
    if name == "one-peer-exp":
        return max(1, n.bit_length() - 1)
    if n == 1:
        return None
    return 2 * ((n // local).bit_length() - 1)


def _spec_groups(name: str, n: int, local: int, t: int) -> list[tuple[int, ...]]:
    """The partition of ranks into uniformly averaging groups in round t, from the spec."""
    paired: list[tuple[int, ...]] = []
    if name == "complete":
        paired = [tuple(range(n))]
    elif n == 1:
        paired = []
    elif name == "ring":
        odd = t % 2
        paired = [(i, i + 1) for i in range(odd, n - 1, 2)]
        if odd and n % 2 == 0:  # (n-1, 0); for n = 2 this is the pair (0, 1) again
            paired.append((0, n - 1))
    elif name == "one-peer-exp":
        k = n.bit_length() - 1
        bit = 1 << (t % k)
        paired = [(i, i ^ bit) for i in range(n) if not i & bit]
    elif name == "alternating-exp-ring":
        nodes = n // local
        k = nodes.bit_length() - 1
        t %= 2 * k
        r, phase = divmod(t, 2)
        bit = 1 << r
        workers = lambda node: tuple(range(node * local, (node + 1) * local))  # noqa: E731
        lower_nodes = [j for j in range(nodes) if not j & bit]  # increasing order
        counter = r * (nodes // 2)  # nodes/2 pairs per r, counted across r
        for c, a in enumerate(lower_nodes, start=counter):
            b = a ^ bit
            inter_phase = 1 if c % 2 == 0 else 0
            if phase == inter_phase:
                paired.append(tuple(sorted(workers(a) + workers(b))))
            else:
                paired += [workers(a), workers(b)]
    else:
        raise AssertionError(name)
    covered = {i for g in paired for i in g}
    groups = [tuple(sorted(g)) for g in paired] + [(i,) for i in range(n) if i not in covered]
    return sorted(groups, key=lambda g: g[0])


def _dense_from_groups(n: int, groups) -> torch.Tensor:
    w = torch.zeros(n, n, dtype=torch.float64)
    for g in groups:
        idx = torch.tensor(g)
        w[idx.unsqueeze(1), idx.unsqueeze(0)] = 1.0 / len(g)
    return w


def _uniform(n: int) -> torch.Tensor:
    return torch.full((n, n), 1.0 / n, dtype=torch.float64)


def _t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def _check_round(topo: Topology, t: int) -> torch.Tensor:
    """Every per-round invariant of one W(t); returns W(t)."""
    n = topo.world_size
    w = topo.mixing_matrix(t)
    assert w.dtype == torch.float64 and w.shape == (n, n)
    assert (w >= 0).all()
    ones = torch.ones(n, dtype=torch.float64)
    torch.testing.assert_close(w.sum(dim=1), ones, rtol=0, atol=SUM_ATOL)  # an average
    torch.testing.assert_close(w.sum(dim=0), ones, rtol=0, atol=SUM_ATOL)  # keeps the mean
    rows = w.tolist()  # plain Python from here: per-entry tensor ops would dominate the run time
    recvs, sends = set(), set()
    for i in range(n):
        row = topo.weights(i, t)
        expected = {j: v for j, v in enumerate(rows[i]) if v > 0}
        assert list(row) == list(expected), (
            f"rank {i} step {t}: keys {list(row)} != nonzeros {list(expected)}"
        )
        assert all(type(j) is int for j in row)
        assert all(isinstance(v, float) for v in row.values())
        assert all(abs(row[j] - v) <= SUM_ATOL for j, v in expected.items()), f"rank {i} step {t}"
        out_peers, in_peers = topo.out_peers(i, t), topo.in_peers(i, t)
        assert out_peers == [j for j in range(n) if j != i and rows[j][i] > 0]
        assert in_peers == [j for j in expected if j != i]
        recvs |= {(j, i) for j in in_peers}  # (sender, receiver)
        sends |= {(i, j) for j in out_peers}
    assert recvs == sends  # an unmatched irecv is a deadlock
    return w


# ---------------------------------------------------------------------------------------------
# 1. Per-round invariants at every accepted size, over two periods.


# One test per case, so that W(t) is built once per round (mixing_matrix is the slow path).
@pytest.mark.parametrize("name, n, local", CASES, ids=CASE_IDS)
def test_rounds_are_doubly_stochastic_follow_the_spec_and_views_agree(name, n, local):
    topo = _make(name, n, local)
    assert isinstance(topo, Topology)
    assert topo.world_size == n and topo.local_world_size == local
    assert isinstance(topo.period, int) and topo.period >= 1
    if _spec_period(name, n, local) is not None:
        assert topo.period == _spec_period(name, n, local)
    for t in range(2 * topo.period):
        w = _check_round(topo, t)
        # 5. groups(): a partition into ascending tuples, sorted by first rank, that rebuilds W(t).
        groups = topo.groups(t)
        assert groups is not None
        assert all(isinstance(g, tuple) and list(g) == sorted(g) for g in groups)
        assert [g[0] for g in groups] == sorted(g[0] for g in groups)
        assert sorted(i for g in groups for i in g) == list(range(n))
        torch.testing.assert_close(_dense_from_groups(n, groups), w)
        # 4. The schedule the spec describes.
        assert groups == _spec_groups(name, n, local, t), f"step {t}"


# ---------------------------------------------------------------------------------------------
# 2. Periodicity and determinism.

_case = st.sampled_from(CASES)


@settings(max_examples=60, deadline=None)
@given(_case, st.integers(0, 10**6))
def test_periodic_and_deterministic(case, t):
    name, n, local = case
    a, b = _make(name, n, local), _make(name, n, local)  # two fresh objects, as on two ranks
    w = a.mixing_matrix(t)
    assert torch.equal(w, a.mixing_matrix(t + a.period))
    assert torch.equal(w, b.mixing_matrix(t))
    assert a.groups(t) == b.groups(t) == _spec_groups(name, n, local, t)
    rank = t % n
    assert a.weights(rank, t) == b.weights(rank, t % b.period)
    assert a.out_peers(rank, t) == b.out_peers(rank, t % b.period)
    assert a.in_peers(rank, t) == b.in_peers(rank, t % b.period)


@settings(max_examples=100, deadline=None)
@given(
    st.one_of(
        st.integers(1, 33).map(RingTopology),
        st.integers(0, 6).map(lambda k: OnePeerExpTopology(2**k)),
        st.tuples(st.integers(1, 4), st.sampled_from([1, 2, 4])).map(
            lambda kl: AlternatingExpRingTopology((2 ** kl[0]) * kl[1], kl[1])
        ),
    ),
    st.integers(0, 10**6),
)
def test_every_receive_has_a_matching_send_at_any_step(topo, t):
    _check_round(topo, t)


# ---------------------------------------------------------------------------------------------
# 3. The period product mixes.


@pytest.mark.parametrize("name, n, local", PRODUCT_CASES, ids=PRODUCT_IDS)
def test_period_product_mixes(name, n, local):
    topo = _make(name, n, local)
    expected = torch.eye(n, dtype=torch.float64)
    for t in range(topo.period):
        expected = topo.mixing_matrix(t) @ expected  # W(p-1) @ ... @ W(0)
    prod = topo.period_product()
    assert prod.dtype == torch.float64
    torch.testing.assert_close(prod, expected)
    gap = topo.spectral_gap()
    assert isinstance(gap, float)
    if n == 1:
        assert gap == 1.0
        return
    sigma = torch.linalg.svdvals(expected)
    assert gap == pytest.approx(1.0 - sigma[1].item(), abs=1e-9)
    assert 0.0 < gap <= 1.0 + 1e-12
    # Contracts toward the mean: ||prod - 11^T/n||_2 < 1.
    assert torch.linalg.matrix_norm(prod - _uniform(n), ord=2) < 1.0


@pytest.mark.parametrize("n", [2**k for k in range(7)])
def test_one_peer_exp_averages_exactly_over_any_window(n):
    topo = OnePeerExpTopology(n)
    k = max(1, n.bit_length() - 1)
    assert topo.period == k
    for start in range(2 * k):
        prod = torch.eye(n, dtype=torch.float64)
        for t in range(start, start + k):
            prod = topo.mixing_matrix(t) @ prod
        torch.testing.assert_close(prod, _uniform(n), rtol=0, atol=1e-12)
    torch.testing.assert_close(topo.period_product(), _uniform(n), rtol=0, atol=1e-12)
    assert topo.spectral_gap() == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64])
def test_complete_spectral_gap_is_one(n):
    assert CompleteTopology(n).spectral_gap() == pytest.approx(1.0, abs=1e-12)


# ---------------------------------------------------------------------------------------------
# 4. Hand-written matrices.

H, T3 = 0.5, 1.0 / 3.0

HAND_WRITTEN = [
    (CompleteTopology(3), 0, [[T3, T3, T3], [T3, T3, T3], [T3, T3, T3]]),
    (CompleteTopology(3), 5, [[T3, T3, T3], [T3, T3, T3], [T3, T3, T3]]),
    (CompleteTopology(1), 0, [[1.0]]),
    (RingTopology(1), 1, [[1.0]]),
    (OnePeerExpTopology(1), 3, [[1.0]]),
    (AlternatingExpRingTopology(1), 0, [[1.0]]),
    (RingTopology(2), 0, [[H, H], [H, H]]),
    (RingTopology(2), 1, [[H, H], [H, H]]),
    # n = 3: rank 2 sits out the even rounds, rank 0 the odd ones.
    (RingTopology(3), 0, [[H, H, 0], [H, H, 0], [0, 0, 1]]),
    (RingTopology(3), 1, [[1, 0, 0], [0, H, H], [0, H, H]]),
    (RingTopology(4), 0, [[H, H, 0, 0], [H, H, 0, 0], [0, 0, H, H], [0, 0, H, H]]),
    (RingTopology(4), 1, [[H, 0, 0, H], [0, H, H, 0], [0, H, H, 0], [H, 0, 0, H]]),
    (RingTopology(4), 3, [[H, 0, 0, H], [0, H, H, 0], [0, H, H, 0], [H, 0, 0, H]]),
    (
        RingTopology(5),
        0,
        [[H, H, 0, 0, 0], [H, H, 0, 0, 0], [0, 0, H, H, 0], [0, 0, H, H, 0], [0, 0, 0, 0, 1]],
    ),
    (
        RingTopology(5),
        1,
        [[1, 0, 0, 0, 0], [0, H, H, 0, 0], [0, H, H, 0, 0], [0, 0, 0, H, H], [0, 0, 0, H, H]],
    ),
    (OnePeerExpTopology(2), 0, [[H, H], [H, H]]),
    (OnePeerExpTopology(4), 0, [[H, H, 0, 0], [H, H, 0, 0], [0, 0, H, H], [0, 0, H, H]]),
    (OnePeerExpTopology(4), 1, [[H, 0, H, 0], [0, H, 0, H], [H, 0, H, 0], [0, H, 0, H]]),
    (OnePeerExpTopology(4), 2, [[H, H, 0, 0], [H, H, 0, 0], [0, 0, H, H], [0, 0, H, H]]),
    # AER, 2 nodes of 1: intra-node round = identity, then the inter-node round.
    (AlternatingExpRingTopology(2), 0, [[1, 0], [0, 1]]),
    (AlternatingExpRingTopology(2), 1, [[H, H], [H, H]]),
    # AER, 2 nodes of 2 workers: node pair (0, 1) gets counter 0 -> intra first.
    (AlternatingExpRingTopology(4, 2), 0, [[H, H, 0, 0], [H, H, 0, 0], [0, 0, H, H], [0, 0, H, H]]),
    (AlternatingExpRingTopology(4, 2), 1, [[0.25] * 4] * 4),
]


@pytest.mark.parametrize(
    "topo, t, rows", HAND_WRITTEN, ids=lambda x: repr(x) if isinstance(x, Topology) else None
)
def test_hand_written_matrices(topo, t, rows):
    torch.testing.assert_close(topo.mixing_matrix(t), _t(rows))


# AER, world size 8 = 4 nodes of L = 2 (node j = ranks 2j, 2j+1).
# r = 0: node pairs (0,1) counter 0, (2,3) counter 1; r = 1: (0,2) counter 2, (1,3) counter 3.
# Even counter: intra-node in round 2r, inter-node in 2r+1; odd counter: the other way round.
AER_8_2_GROUPS = [
    [(0, 1), (2, 3), (4, 5, 6, 7)],  # round 0: pair (0,1) intra, pair (2,3) inter
    [(0, 1, 2, 3), (4, 5), (6, 7)],  # round 1: pair (0,1) inter, pair (2,3) intra
    [(0, 1), (2, 3, 6, 7), (4, 5)],  # round 2: pair (0,2) intra, pair (1,3) inter
    [(0, 1, 4, 5), (2, 3), (6, 7)],  # round 3: pair (0,2) inter, pair (1,3) intra
]
Q = 0.25
AER_8_2_ROUND_0 = [
    [H, H, 0, 0, 0, 0, 0, 0],
    [H, H, 0, 0, 0, 0, 0, 0],
    [0, 0, H, H, 0, 0, 0, 0],
    [0, 0, H, H, 0, 0, 0, 0],
    [0, 0, 0, 0, Q, Q, Q, Q],
    [0, 0, 0, 0, Q, Q, Q, Q],
    [0, 0, 0, 0, Q, Q, Q, Q],
    [0, 0, 0, 0, Q, Q, Q, Q],
]


def test_alternating_exp_ring_8_workers_2_per_node():
    topo = AlternatingExpRingTopology(8, 2)
    assert topo.period == 4
    torch.testing.assert_close(topo.mixing_matrix(0), _t(AER_8_2_ROUND_0))
    for t in range(8):
        groups = AER_8_2_GROUPS[t % 4]
        assert topo.groups(t) == groups
        torch.testing.assert_close(topo.mixing_matrix(t), _dense_from_groups(8, groups))
    assert topo.weights(4, 0) == {4: 0.25, 5: 0.25, 6: 0.25, 7: 0.25}
    assert topo.out_peers(4, 0) == [5, 6, 7]
    assert topo.in_peers(2, 2) == [3, 6, 7]
    assert topo.weights(0, 3) == {0: 0.25, 1: 0.25, 4: 0.25, 5: 0.25}


def test_alternating_exp_ring_4_nodes_of_1():
    topo = AlternatingExpRingTopology(4)
    assert topo.period == 4
    assert [topo.groups(t) for t in range(4)] == [
        [(0,), (1,), (2, 3)],
        [(0, 1), (2,), (3,)],
        [(0,), (1, 3), (2,)],
        [(0, 2), (1,), (3,)],
    ]


@pytest.mark.parametrize("n", [3, 5, 7, 33, 63])
def test_odd_ring_left_out_worker_keeps_its_value(n):
    topo = RingTopology(n)
    for t in range(4):
        left_out = n - 1 if t % 2 == 0 else 0
        assert topo.weights(left_out, t) == {left_out: 1.0}
        assert topo.out_peers(left_out, t) == [] and topo.in_peers(left_out, t) == []
        for i in set(range(n)) - {left_out}:
            assert len(topo.weights(i, t)) == 2 and set(topo.weights(i, t).values()) == {0.5}
    # Nobody is left out when n is even.
    even = RingTopology(n + 1)
    for t in range(4):
        assert all(len(even.out_peers(i, t)) == 1 for i in range(n + 1))


def test_ring_weights_and_peers_by_hand():
    topo = RingTopology(6)
    assert topo.weights(0, 0) == {0: 0.5, 1: 0.5}
    assert topo.weights(0, 1) == {0: 0.5, 5: 0.5}
    assert topo.weights(5, 1) == {0: 0.5, 5: 0.5}
    assert topo.out_peers(3, 0) == [2] and topo.in_peers(3, 1) == [4]


RING_3_PRODUCT = [[H, H, 0], [0.25, 0.25, H], [0.25, 0.25, H]]  # W(1) @ W(0), worked by hand


def test_ring_3_period_product_and_gap():
    topo = RingTopology(3)
    torch.testing.assert_close(topo.period_product(), _t(RING_3_PRODUCT))
    # P P^T has eigenvalues 1, 1/4, 0, so the second singular value is 1/2.
    assert topo.spectral_gap() == pytest.approx(0.5, abs=1e-12)


def test_ring_6_period_product_order():
    # Row 0 of W(1) @ W(0) is (W0[0] + W0[5]) / 2; of W(0) @ W(1) it would be (W1[0] + W1[1]) / 2.
    row0 = RingTopology(6).period_product()[0]
    torch.testing.assert_close(row0, _t([0.25, 0.25, 0, 0, 0.25, 0.25]))


@pytest.mark.parametrize("n", [2, 4])
def test_ring_2_and_4_average_exactly_over_a_period(n):
    topo = RingTopology(n)
    torch.testing.assert_close(topo.period_product(), _uniform(n), rtol=0, atol=1e-12)
    assert topo.spectral_gap() == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("name", list(NAMES))
def test_world_size_one_is_identity(name):
    topo = _make(name, 1)
    for t in range(3):
        assert topo.weights(0, t) == {0: 1.0}
        assert topo.out_peers(0, t) == [] and topo.in_peers(0, t) == []
        assert topo.groups(t) == [(0,)]
        torch.testing.assert_close(topo.mixing_matrix(t), _t([[1.0]]))
    assert topo.spectral_gap() == 1.0


def test_repr():
    assert repr(RingTopology(4)) == "RingTopology(world_size=4)"
    assert repr(CompleteTopology(3)) == "CompleteTopology(world_size=3)"
    assert repr(OnePeerExpTopology(8)) == "OnePeerExpTopology(world_size=8)"
    text = repr(AlternatingExpRingTopology(8, 2))
    assert text.startswith("AlternatingExpRingTopology(") and "world_size=8" in text


def test_package_exports_base_class():
    assert decent_optim.Topology is Topology
    for cls in [*NAMES.values(), CustomTopology]:
        assert issubclass(cls, Topology)


# ---------------------------------------------------------------------------------------------
# 5. groups()


# groups() of the named topologies: see test_rounds_are_doubly_stochastic_follow_the_spec_and_views_agree.

LAZY_METROPOLIS_PATH_3 = [[5 / 6, 1 / 6, 0], [1 / 6, 4 / 6, 1 / 6], [0, 1 / 6, 5 / 6]]
# Uniform weights 1/2 on a directed 4-cycle: every row looks like a pair, but no block structure.
HALF_CYCLE_4 = [[H, H, 0, 0], [0, H, H, 0], [0, 0, H, H], [H, 0, 0, H]]


@pytest.mark.parametrize(
    "rows", [LAZY_METROPOLIS_PATH_3, HALF_CYCLE_4], ids=["metropolis-path3", "half-cycle4"]
)
def test_groups_is_none_without_block_structure(rows):
    topo = CustomTopology([rows])
    assert topo.groups(0) is None
    assert topo.groups(1) is None


def test_custom_groups_per_round():
    pairs = [[H, H, 0, 0], [H, H, 0, 0], [0, 0, H, H], [0, 0, H, H]]
    topo = CustomTopology([pairs, HALF_CYCLE_4, _uniform(4)])
    assert topo.groups(0) == [(0, 1), (2, 3)]
    assert topo.groups(1) is None
    assert topo.groups(2) == [(0, 1, 2, 3)]
    assert topo.groups(3) == [(0, 1), (2, 3)]
    lone = CustomTopology([[[1, 0, 0], [0, H, H], [0, H, H]], [[H, H, 0], [H, H, 0], [0, 0, 1]]])
    assert lone.groups(0) == [(0,), (1, 2)]


# ---------------------------------------------------------------------------------------------
# 6. CustomTopology


RING_3_ROUNDS = [[[H, H, 0], [H, H, 0], [0, 0, 1]], [[1, 0, 0], [0, H, H], [0, H, H]]]
RING_3_DICTS = [
    [{0: H, 1: H}, {0: H, 1: H}, {2: 1.0}],
    [{0: 1.0}, {1: H, 2: H}, {1: H, 2: H}],
]


@pytest.mark.parametrize(
    "schedule",
    [
        RING_3_ROUNDS,
        [_t(r) for r in RING_3_ROUNDS],
        [_t(r).float() for r in RING_3_ROUNDS],
        RING_3_DICTS,
        [_t(RING_3_ROUNDS[0]), RING_3_DICTS[1]],  # formats may be mixed across rounds
    ],
    ids=["nested-lists", "tensors", "float32-tensors", "neighbour-dicts", "mixed"],
)
def test_custom_reproduces_its_schedule(schedule):
    topo = CustomTopology(schedule, local_world_size=1)
    assert topo.world_size == 3 and topo.local_world_size == 1 and topo.period == 2
    for t in range(4):
        torch.testing.assert_close(topo.mixing_matrix(t), _t(RING_3_ROUNDS[t % 2]))
        for i in range(3):
            assert topo.weights(i, t) == RING_3_DICTS[t % 2][i]
        _check_round(topo, t)
    torch.testing.assert_close(topo.period_product(), _t(RING_3_PRODUCT))
    assert topo.spectral_gap() == pytest.approx(0.5, abs=1e-12)


def test_custom_period_product_order():
    # W(1) @ W(0) is RING_3_PRODUCT; the reverse order gives its transpose.
    topo = CustomTopology([RING_3_ROUNDS[1], RING_3_ROUNDS[0]])
    torch.testing.assert_close(topo.period_product(), _t(RING_3_PRODUCT).T)


def test_custom_non_uniform_weights():
    topo = CustomTopology([LAZY_METROPOLIS_PATH_3], local_world_size=1)
    assert topo.period == 1
    torch.testing.assert_close(topo.mixing_matrix(7), _t(LAZY_METROPOLIS_PATH_3))
    assert list(topo.weights(1, 0)) == [0, 1, 2]
    assert topo.weights(1, 0)[1] == pytest.approx(4 / 6)
    assert topo.out_peers(0, 0) == [1] and topo.in_peers(2, 0) == [1]
    assert 0 < topo.spectral_gap() < 1
    # The directed half-cycle: rank i reads from i+1, so i-1 needs rank i's value.
    cycle = CustomTopology([HALF_CYCLE_4])
    assert cycle.in_peers(0, 0) == [1] and cycle.out_peers(0, 0) == [3]
    _check_round(cycle, 0)


def test_custom_keeps_local_world_size_and_repr():
    topo = CustomTopology([_uniform(4)], local_world_size=2)
    assert topo.local_world_size == 2 and topo.world_size == 4
    assert repr(topo).startswith("CustomTopology(")


def test_custom_accepts_sums_within_tolerance():
    eps = 1e-9  # well inside the 1e-6 tolerance
    CustomTopology([[[H + eps, H - eps], [H - eps, H + eps]]])


@pytest.mark.parametrize(
    "schedule, pattern",
    [
        ([], r"(?i)empty|at least one|non-empty"),
        ([[[H, H]]], r"(?i)square"),
        ([[[H, H], [H, H]], [[T3] * 3] * 3], r"(?i)round 1"),
        ([[[1.5, -0.5], [-0.5, 1.5]]], r"(?i)negative|>= ?0|-0\.5"),
        ([[[1.0, 1.0], [0.0, 0.0]]], r"(?i)row 0.*\b2"),  # rows sum to 2 and 0, columns to 1
        ([[[H, H], [H, H]], [[1.0, 0.0], [1.0, 0.0]]], r"(?i)round 1.*column 0.*\b2"),  # rows fine
        ([[[H, H], [H, H]], [[0.6, 0.4], [0.4, 0.5]]], r"(?i)round 1.*(row|column)"),  # off by 0.1
        ([[[H + 1e-4, H], [H - 1e-4, H]]], r"(?i)row 0"),  # off by 1e-4, outside the 1e-6 tolerance
        ([[{0: 1.0}, {1: H, 5: H}, {2: 1.0}]], r"(?i)(?=.*round 0)(?=.*\b5\b)"),  # no rank 5 of 3
        ([torch.eye(3, dtype=torch.float64)], r"(?i)mix|singular|spectral|connect"),
        ([[[0.0, 1.0], [1.0, 0.0]]], r"(?i)mix|singular|spectral|connect"),  # a swap never averages
        (
            [[[H, H, 0, 0], [H, H, 0, 0], [0, 0, H, H], [0, 0, H, H]]] * 2,
            r"(?i)mix|singular|spectral|connect",
        ),
    ],
    ids=[
        "empty",
        "non-square",
        "size-changes",
        "negative",
        "row-sum",
        "column-sum",
        "sum-off",
        "sum-off-1e-4",
        "dict-source-out-of-range",
        "identity-never-mixes",
        "permutation-never-mixes",
        "disconnected",
    ],
)
def test_custom_validation_errors(schedule, pattern):
    with pytest.raises(ValueError, match=pattern):
        CustomTopology(schedule)


def _doubly_stochastic(n: int):
    """Random doubly stochastic (n, n) matrices: a convex mix of permutations (Birkhoff) and J/n."""

    @st.composite
    def build(draw):
        perms = draw(st.lists(st.permutations(range(n)), min_size=1, max_size=4))
        coeffs = draw(st.lists(st.integers(1, 4), min_size=len(perms) + 1, max_size=len(perms) + 1))
        total = sum(coeffs)
        w = coeffs[-1] / total * _uniform(n)  # the uniform part guarantees mixing
        for c, perm in zip(coeffs, perms):
            w[torch.arange(n), torch.tensor(perm, dtype=torch.long)] += c / total
        return w

    return build()


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 6).flatmap(lambda n: st.lists(_doubly_stochastic(n), min_size=1, max_size=3)))
def test_custom_round_trips_random_doubly_stochastic_schedules(schedule):
    n = schedule[0].shape[0]
    as_dicts = [
        [{j: v for j, v in enumerate(row) if v > 0} for row in w.tolist()] for w in schedule
    ]
    for given_schedule in (schedule, [w.tolist() for w in schedule], as_dicts):
        topo = CustomTopology(given_schedule)
        assert topo.world_size == n and topo.period == len(schedule)
        for t in range(topo.period):
            w = _check_round(topo, t)
            torch.testing.assert_close(w, schedule[t])
            groups = topo.groups(t)
            if groups is not None:
                torch.testing.assert_close(_dense_from_groups(n, groups), w)
        if n > 1:
            assert topo.spectral_gap() > 0


def test_custom_column_error_names_the_column():
    # The spec's own example: column 2 of round 1 sums to 0.5 (and column 1 to 1.5).
    bad = [[1.0, 0, 0], [0, H, H], [0, 1.0, 0]]
    with pytest.raises(ValueError, match=r"(?i)round 1\b.*column [12]\b"):
        CustomTopology([_uniform(3), bad])


# ---------------------------------------------------------------------------------------------
# 7. get()


@pytest.mark.parametrize("name, n, local", CASES, ids=CASE_IDS)
def test_get_names_map_to_classes(name, n, local):
    topo = topologies.get(name, n, local)
    assert type(topo) is NAMES[name]
    assert topo.world_size == n and topo.local_world_size == local


def test_get_default_local_world_size():
    assert topologies.get("alternating-exp-ring", 8).local_world_size == 1
    assert topologies.get("ring", 5).local_world_size == 1


def test_get_unknown_name_lists_valid_names():
    pattern = "(?s)" + "".join(f"(?=.*{re.escape(name)})" for name in NAMES)
    with pytest.raises(ValueError, match=pattern):
        topologies.get("torus", 4)


@pytest.mark.parametrize("n", [3, 6, 12, 63])
def test_get_one_peer_exp_needs_power_of_two(n):
    with pytest.raises(ValueError, match=rf"(?is)(?=.*one-peer-exp)(?=.*power)(?=.*\b{n}\b)"):
        topologies.get("one-peer-exp", n)
    with pytest.raises(ValueError, match=r"(?i)power"):
        OnePeerExpTopology(n)


@pytest.mark.parametrize(
    "n, local",
    [(3, 1), (6, 1), (12, 2), (24, 4), (6, 2)],
    ids=["3x1", "6x1", "6-nodes-of-2", "6-nodes-of-4", "3-nodes-of-2"],
)
def test_get_alternating_exp_ring_needs_power_of_two_nodes(n, local):
    with pytest.raises(ValueError, match=r"(?is)(?=.*alternating-exp-ring)(?=.*power)"):
        topologies.get("alternating-exp-ring", n, local)
    with pytest.raises(ValueError, match=r"(?i)power"):
        AlternatingExpRingTopology(n, local)


@pytest.mark.parametrize("n, local", [(2, 2), (4, 4)])
def test_get_alternating_exp_ring_needs_two_nodes(n, local):
    with pytest.raises(ValueError, match=r"(?is)(?=.*alternating-exp-ring)(?=.*(node|2))"):
        topologies.get("alternating-exp-ring", n, local)
    with pytest.raises(ValueError):
        AlternatingExpRingTopology(n, local)


def test_get_passes_instances_through():
    topo = RingTopology(4)
    assert topologies.get(topo, 4) is topo
    custom = CustomTopology([_uniform(3)])
    assert topologies.get(custom, 3) is custom


def test_get_instance_world_size_mismatch():
    with pytest.raises(ValueError, match=r"(?s)(?=.*\b4\b)(?=.*\b8\b)"):
        topologies.get(RingTopology(4), 8)


@pytest.mark.parametrize("name", list(NAMES))
@pytest.mark.parametrize("n", [0, -1, -8])
def test_get_world_size_must_be_positive(name, n):
    with pytest.raises(ValueError, match=r"world_size"):
        topologies.get(name, n)
    with pytest.raises(ValueError):
        NAMES[name](n)


@pytest.mark.parametrize("n", [2.0, "4", None])
def test_get_world_size_must_be_an_int(n):
    # The spec says ValueError; style.md's "TypeError for a bad type" is accepted as well.
    with pytest.raises((ValueError, TypeError), match=r"world_size"):
        topologies.get("ring", n)


@pytest.mark.parametrize("name", list(NAMES))
@pytest.mark.parametrize("n, local", [(6, 4), (8, 3), (4, 0)])
def test_get_world_size_must_divide_by_local_world_size(name, n, local):
    with pytest.raises(ValueError, match=r"local_world_size"):
        topologies.get(name, n, local)
    with pytest.raises(ValueError):
        NAMES[name](n, local_world_size=local)


def test_math_reference_is_self_consistent():
    # Guards the reference itself: the spec's AER pairs each node exactly once per round.
    for nodes in (2, 4, 8, 16):
        k = int(math.log2(nodes))
        for t in range(2 * k):
            groups = _spec_groups("alternating-exp-ring", nodes * 2, 2, t)
            assert sorted(i for g in groups for i in g) == list(range(nodes * 2))
            assert {len(g) for g in groups} <= {2, 4}


@pytest.mark.parametrize("n, local", [(4, 4), (8, 8), (2, 2)])
def test_alternating_exp_ring_on_one_node_says_what_to_pass_instead(n, local):
    """README's recommended setting run with torchrun on one machine (LOCAL_WORLD_SIZE = n)."""
    with pytest.raises(ValueError) as info:
        topologies.get("alternating-exp-ring", n, local)
    message = str(info.value)
    for part in ("1 node", 'topology="ring"', 'topology="one-peer-exp"', "local_world_size=1"):
        assert part in message, (part, message)
    # what it says works: the alternatives build on that one node
    topologies.get("ring", n, local)
    topologies.get("one-peer-exp", n, local)
    topologies.get("alternating-exp-ring", n, 1)


@pytest.mark.parametrize("n, local", [(6, 2), (12, 4), (3, 1)])
def test_alternating_exp_ring_on_other_node_counts_says_what_to_pass_instead(n, local):
    with pytest.raises(ValueError) as info:
        topologies.get("alternating-exp-ring", n, local)
    message = str(info.value)
    assert f"{n // local} nodes" in message and 'topology="ring"' in message, message
    topologies.get("ring", n, local)

"""``base-<b>`` (``decent_optim.topologies.finite_time``) against dense matrix products.

The product of one period's mixing matrices must be the exact mean, each round a partition into
groups of at most ``b`` ranks with uniform weights, the period ``log_b n`` when ``n`` is a power
of ``b``; sizes with a prime factor above ``b`` are refused with what to do.
"""

from __future__ import annotations

import math

import pytest
import torch

from decent_optim import topologies


@pytest.mark.parametrize(
    "n,b,period",
    [(16, 4, 2), (64, 4, 3), (8, 2, 3), (27, 3, 3), (12, 4, 2), (8, 4, 2), (6, 4, 2), (32, 8, 2), (1, 4, 1)],
)  # fmt: skip
def test_one_period_gives_the_exact_mean(n, b, period):
    topo = topologies.get(f"base-{b}", n)
    assert topo.period == period
    product = torch.eye(n, dtype=torch.float64)
    for r in range(topo.period):
        w = topo.mixing_matrix(r).double()
        torch.testing.assert_close(w.sum(0), torch.ones(n, dtype=torch.float64))
        torch.testing.assert_close(w.sum(1), torch.ones(n, dtype=torch.float64))
        for g in topo.groups(r):
            assert len(g) <= b
            assert all(math.isclose(float(w[i, j]), 1 / len(g)) for i in g for j in g)
        product = w @ product
    torch.testing.assert_close(product, torch.full((n, n), 1 / n, dtype=torch.float64))
    if n > 1:  # one round short of the period is not the mean
        partial = torch.eye(n, dtype=torch.float64)
        for r in range(topo.period - 1):
            partial = topo.mixing_matrix(r).double() @ partial
        assert not torch.allclose(partial, product)


def test_base_two_is_one_peer_exp():
    two, hypercube = topologies.get("base-2", 16), topologies.get("one-peer-exp", 16)
    assert two.period == hypercube.period
    for r in range(two.period):
        assert sorted(two.groups(r)) == sorted(hypercube.groups(r))


def test_the_first_round_groups_consecutive_ranks():
    assert topologies.get("base-4", 16, 2).groups(0)[:2] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert topologies.get("base-4", 16, 2).groups(1)[0] == (0, 4, 8, 12)


def test_sizes_and_names_it_refuses():
    with pytest.raises(ValueError, match=r"prime factors are all at most 4; 10 has the factor 5"):
        topologies.get("base-4", 10)
    with pytest.raises(ValueError, match="base must be at least 2"):
        topologies.get("base-1", 4)
    with pytest.raises(ValueError, match=r"unknown topology 'base-x'.*'base-<b>'"):
        topologies.get("base-x", 4)
    assert "base-4" not in topologies.names()  # plan measures every name that fits

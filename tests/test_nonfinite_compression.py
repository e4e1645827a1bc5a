"""Compressed gossip and non-finite values: reported by the rank that sends them, and gone from
the public copies once every rank has repaired its parameters, as with exact gossip.

Before: with int8 one NaN on one rank made its whole 1024-value chunk NaN on every rank, and it
stayed so after every rank had repaired its parameters (the public copies kept the NaN, and every
later difference against them was NaN); bf16 kept the one bad value. Nothing was reported.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from _harness import run_world

import decent_optim as dopt

NUMEL = 2048


def _poison_then_repair(rank, world_size, compression):
    x = torch.nn.Parameter(torch.arange(NUMEL, dtype=torch.float32) / NUMEL + rank)
    opt = dopt.DSGD([x], lr=0.0, local_world_size=1, compression=compression)
    seen = []

    def step():
        x.grad = torch.zeros_like(x)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        seen.extend(str(w.message) for w in caught if "non-finite" in str(w.message))

    for _ in range(3):
        step()
    opt.synchronize()
    if rank == 0:
        with torch.no_grad():
            x[5] = float("nan")
    for _ in range(3):
        step()
    opt.synchronize()
    poisoned = int((~torch.isfinite(x.detach())).sum())
    with torch.no_grad():  # every rank repairs its parameters
        x.copy_(torch.arange(NUMEL, dtype=torch.float32) / NUMEL + rank)
    for _ in range(4):
        step()
    opt.synchronize()
    return poisoned, x.detach().clone(), seen


@pytest.mark.multiprocess
@pytest.mark.parametrize("compression", ["bf16", "int8", None])
def test_non_finite_values_are_reported_and_do_not_persist_after_repair(compression):
    results = run_world(_poison_then_repair, 2, compression)
    for rank, (poisoned, x, seen) in enumerate(results):
        assert poisoned > 0, "the NaN should have reached every rank, as with exact gossip"
        assert bool(torch.isfinite(x).all()), f"rank {rank}: {int((~torch.isfinite(x)).sum())}"
        mean = torch.arange(NUMEL, dtype=torch.float32) / NUMEL + 0.5
        torch.testing.assert_close(x, mean, rtol=0, atol=1e-2)  # consensus after the repair
        if compression is not None:
            reports = [m for m in seen if m.startswith("[rank 0] compressed gossip round ")]
            assert bool(reports) == (rank == 0), seen  # the sender reports, once
            assert len(reports) <= 1, seen

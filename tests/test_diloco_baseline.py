"""The DiLoCo baseline (``benchmarks/_diloco.py``) against a float64 loop written out here.

The baseline that the time-to-quality benchmark and the convergence study's ``local`` stage
measure the local-step modes against: 2 gloo ranks, each its own quadratic, inner SGD with
momentum (its state must survive the outer steps), H = 2, 7 steps (three periods and one
step into the fourth). The reference below spells out DiLoCo's outer step (Douillard et al.
2023): average the pseudo-gradients, torch.optim.SGD's Nesterov momentum step on the outer
parameters, every worker restarts from them.
"""

from __future__ import annotations

import pytest
import torch
from _harness import run_world

from benchmarks._diloco import DiLoCo

H, STEPS, INNER_LR, INNER_MOMENTUM = 2, 7, 0.1, 0.5
OUTER = dict(lr=0.7, momentum=0.9)
TARGETS = [torch.tensor(t, dtype=torch.float64) for t in ([1.0, -2.0, 0.5], [-3.0, 0.25, 2.0])]
START = torch.tensor([0.5, 0.5, -1.0], dtype=torch.float64)


def _grad(rank: int, x: torch.Tensor) -> torch.Tensor:
    """Gradient of rank's loss 0.5 * sum(scale * (x - target)^2): a different quadratic per rank."""
    scale = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64) * (rank + 1)
    return scale * (x - TARGETS[rank])


def _baseline(rank: int, world: int, nesterov: bool) -> dict:
    x = torch.nn.Parameter(START.clone())
    inner = torch.optim.SGD([x], lr=INNER_LR, momentum=INNER_MOMENTUM)
    opt = DiLoCo([x], inner, H, nesterov=nesterov, **OUTER)
    for _ in range(STEPS):
        opt.zero_grad()
        x.grad = _grad(rank, x.detach())
        opt.step()
    with opt.averaged():
        mean = x.detach().clone()
    return {"x": x.detach().clone(), "mean": mean, "distance": opt.consensus_distance()}


def _reference(nesterov: bool) -> list[torch.Tensor]:
    """Every worker's parameters after STEPS, the textbook way, float64."""
    theta, outer_buf = START.clone(), None
    x = [START.clone() for _ in TARGETS]
    inner_buf: list[torch.Tensor | None] = [None for _ in TARGETS]
    for step in range(1, STEPS + 1):
        for i in range(len(x)):
            g = _grad(i, x[i])
            inner_buf[i] = g if inner_buf[i] is None else INNER_MOMENTUM * inner_buf[i] + g
            x[i] = x[i] - INNER_LR * inner_buf[i]
        if step % H == 0:
            delta = sum(theta - xi for xi in x) / len(x)
            outer_buf = delta if outer_buf is None else OUTER["momentum"] * outer_buf + delta
            update = delta + OUTER["momentum"] * outer_buf if nesterov else outer_buf
            theta = theta - OUTER["lr"] * update
            x = [theta.clone() for _ in x]
    return x


@pytest.mark.multiprocess
@pytest.mark.parametrize("nesterov", [True, False])
def test_diloco_matches_a_float64_loop(nesterov: bool) -> None:
    got = run_world(_baseline, 2, nesterov)
    want = _reference(nesterov)
    mean = sum(want) / 2
    for rank in range(2):
        torch.testing.assert_close(got[rank]["x"], want[rank], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got[rank]["mean"], mean, rtol=1e-12, atol=1e-12)
        expected = float((want[rank] - mean).norm())
        assert got[rank]["distance"] == pytest.approx(expected, rel=1e-10)
        assert expected > 0.1  # one step into a period, the workers differ

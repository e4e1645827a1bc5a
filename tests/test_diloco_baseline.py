"""The DiLoCo baseline (``benchmarks/_diloco.py``) against a float64 loop written out here.

The baseline that the time-to-quality benchmark and the convergence study's ``local`` stage
measure the local-step modes against: 2 gloo ranks, each its own quadratic, inner SGD with
momentum (its state must survive the outer steps), H = 2, 7 steps (three periods and one
step into the fourth). The reference below spells out DiLoCo's outer step (Douillard et al.
2023): average the pseudo-gradients, torch.optim.SGD's Nesterov momentum step on the outer
parameters, every worker restarts from them. With ``:hetero`` (``diloco:H4:hetero`` at speeds
1 and 0.5, through the benchmark's registry) rank 1 syncs after 2 AdamW steps where rank 0 takes
4, and the outer step is the same plain mean.
"""

from __future__ import annotations

import sys
from pathlib import Path

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


# -- :hetero: each rank its own H from its speed (benchmarks/methods.py, torchft's answer) -------
SPEEDS, PERIODS = "1,0.5", 3  # rank 1 at half speed: H4 -> 4 and 2 inner steps a period
ADAMW = dict(lr=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _hetero(rank: int, world: int) -> dict:
    import types

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import methods

    m = methods.parse("diloco:H4:hetero")
    h = methods.local_steps(m, SPEEDS, world)[rank]
    x = torch.nn.Parameter(START.clone())
    args = types.SimpleNamespace(lr=ADAMW["lr"])
    ctx = types.SimpleNamespace(args=args, model=None, params=[x], groups=[{"params": [x], "weight_decay": 0.1}],
                                betas=ADAMW["betas"], decent_lr=0.0, H=h)  # fmt: skip
    opt = methods.REGISTRY["diloco"].build(m, ctx).opt

    def steps(k: int) -> None:
        for _ in range(k):
            opt.zero_grad()
            x.grad = _grad(rank, x.detach())
            opt.step()

    steps(PERIODS * h)  # every rank at its PERIODS-th sync
    synced = x.detach().clone()
    steps(1)  # one step into the next period
    return {"h": h, "synced": synced, "x": x.detach().clone()}


def _hetero_reference(hs: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The outer parameters after PERIODS syncs and each worker's one step past them: worker i
    takes hs[i] AdamW steps (its state kept across periods) a period, float64."""
    lr, (b1, b2), eps, wd = ADAMW["lr"], ADAMW["betas"], ADAMW["eps"], ADAMW["weight_decay"]
    theta, outer_buf = START.clone(), None
    x = [START.clone() for _ in hs]
    m1, m2, t = [torch.zeros(3, dtype=torch.float64) for _ in hs], [torch.zeros(3, dtype=torch.float64) for _ in hs], [0] * len(hs)  # fmt: skip

    def adamw(i: int) -> None:
        g = _grad(i, x[i])
        t[i] += 1
        m1[i] = b1 * m1[i] + (1 - b1) * g
        m2[i] = b2 * m2[i] + (1 - b2) * g * g
        x[i] = x[i] * (1 - lr * wd)
        mhat, vhat = m1[i] / (1 - b1 ** t[i]), m2[i] / (1 - b2 ** t[i])
        x[i] = x[i] - lr * mhat / (vhat.sqrt() + eps)

    for _ in range(PERIODS):
        for i, h in enumerate(hs):
            for _ in range(h):
                adamw(i)
        delta = sum(theta - xi for xi in x) / len(x)  # the plain mean, not weighted by H_i
        outer_buf = delta if outer_buf is None else OUTER["momentum"] * outer_buf + delta
        theta = theta - OUTER["lr"] * (delta + OUTER["momentum"] * outer_buf)
        x = [theta.clone() for _ in x]
    for i in range(len(hs)):
        adamw(i)
    return theta, x


@pytest.mark.multiprocess
def test_hetero_syncs_after_each_ranks_own_h_as_a_float64_loop() -> None:
    got = run_world(_hetero, 2)
    assert [r["h"] for r in got] == [4, 2]
    theta, want = _hetero_reference([4, 2])
    for rank in range(2):
        torch.testing.assert_close(got[rank]["synced"], theta, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got[rank]["x"], want[rank], rtol=1e-12, atol=1e-12)
    # the speeds matter: with the same H on both ranks the outer parameters differ
    same_h, _ = _hetero_reference([4, 4])
    assert float((theta - same_h).norm()) > 1e-3

"""Streaming DiLoCo (``benchmarks/_streaming_diloco.py``) against DiLoCo and a float64 loop.

2 gloo ranks. With one fragment, no delay, alpha 0 and no quantisation it must be
``_diloco.DiLoCo`` bit for bit (AdamW inner steps on a small float32 model). With fragments, a
delay and a merge it must follow the paper's algorithm written out below in float64: strided
fragments, each sent at its staggered steps, the mean outer gradient applied ``tau`` steps
later by outer Nesterov SGD, and the merge ``x <- alpha x + (1 - alpha) theta``. The quantised
exchange must give every rank the same mean, within the quantisation's error bound.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from _harness import run_world

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _diloco import DiLoCo  # noqa: E402  (the benchmarks import each other by these names)
from _streaming_diloco import (  # noqa: E402
    CHUNK,
    StreamingDiLoCo,
    dequantize,
    pack,
    quantize,
    unpack,
)

INNER_LR, INNER_MOMENTUM, OUTER_LR, OUTER_MOMENTUM = 0.1, 0.5, 0.7, 0.9
LAYERS = 5  # layers of 2 values each
TARGETS = [torch.linspace(-2, 3, 2 * LAYERS, dtype=torch.float64), torch.linspace(4, -1, 2 * LAYERS, dtype=torch.float64)]  # fmt: skip
SCALES = torch.linspace(0.5, 2.0, 2 * LAYERS, dtype=torch.float64)


def _grad(rank: int, x: torch.Tensor) -> torch.Tensor:
    """A different quadratic per rank."""
    return SCALES * (rank + 1) * (x - TARGETS[rank])


def _against_diloco(rank: int, world: int) -> list[bool]:
    torch.manual_seed(0)
    nets = [torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))]
    nets.append(
        torch.nn.Sequential(*[torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)])
    )
    nets[1].load_state_dict(nets[0].state_dict())
    opts = [
        DiLoCo(nets[0].parameters(), torch.optim.AdamW(nets[0].parameters(), lr=0.05), 3),
        StreamingDiLoCo([[p] for p in nets[1].parameters()], torch.optim.AdamW(nets[1].parameters(), lr=0.05), 3),
    ]  # fmt: skip
    gen = torch.Generator().manual_seed(rank)
    for _ in range(10):
        x, y = torch.randn(16, 6, generator=gen), torch.randn(16, 3, generator=gen)
        for net, opt in zip(nets, opts):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
    opts[1].close()
    return [torch.equal(a, b) for a, b in zip(nets[0].parameters(), nets[1].parameters())]


@pytest.mark.multiprocess
def test_one_fragment_no_delay_is_diloco_bit_for_bit() -> None:
    for equal in run_world(_against_diloco, 2):
        assert equal and all(equal)


def _streaming(rank: int, world: int, fragments: int, h: int, tau: int, alpha: float, steps: int) -> torch.Tensor:  # fmt: skip
    x = torch.zeros(2 * LAYERS, dtype=torch.float64)
    layers = [torch.nn.Parameter(x[2 * i : 2 * i + 2].clone()) for i in range(LAYERS)]
    inner = torch.optim.SGD(layers, lr=INNER_LR, momentum=INNER_MOMENTUM)
    opt = StreamingDiLoCo(
        [[p] for p in layers], inner, h, fragments=fragments, delay=tau, alpha=alpha
    )
    for _ in range(steps):
        opt.zero_grad()
        g = _grad(rank, torch.cat([p.detach() for p in layers]))
        for i, p in enumerate(layers):
            p.grad = g[2 * i : 2 * i + 2].clone()
        opt.step()
    opt.close()
    return torch.cat([p.detach() for p in layers])


def _reference(fragments: int, h: int, tau: int, alpha: float, steps: int, sends: dict[int, list[int]]) -> list[torch.Tensor]:  # fmt: skip
    """The paper's algorithm, float64, on every worker at once; ``sends[f]``: the steps
    after which fragment f's outer gradient is sent."""
    n = len(TARGETS)
    x = [torch.zeros(2 * LAYERS, dtype=torch.float64) for _ in range(n)]
    buf = [torch.zeros_like(x[0]) for _ in range(n)]
    theta, outer_buf = x[0].clone(), torch.zeros_like(x[0])
    started = [False] * fragments
    members = []  # value indices of each fragment: layer i in fragment i mod F
    for f in range(fragments):
        members.append(
            torch.tensor([2 * i + k for i in range(f, LAYERS, fragments) for k in (0, 1)])
        )
    in_flight: dict[int, tuple[int, torch.Tensor]] = {}
    for step in range(1, steps + 1):
        for i in range(n):
            g = _grad(i, x[i])
            buf[i] = g if step == 1 else INNER_MOMENTUM * buf[i] + g
            x[i] = x[i] - INNER_LR * buf[i]
        for f in range(fragments):
            if step in sends[f]:
                idx = members[f]
                mean = sum(theta[idx] - xi[idx] for xi in x) / n
                in_flight[f] = (step + tau, mean)
        for f, (due, mean) in list(in_flight.items()):
            if due != step:
                continue
            del in_flight[f]
            idx = members[f]
            outer_buf[idx] = OUTER_MOMENTUM * outer_buf[idx] + mean if started[f] else mean
            started[f] = True
            theta[idx] = theta[idx] - OUTER_LR * (mean + OUTER_MOMENTUM * outer_buf[idx])
            for xi in x:
                xi[idx] = alpha * xi[idx] + (1 - alpha) * theta[idx]
    return x


CASES = {
    # fragments, H, tau, alpha, steps, the send steps of each fragment (staggered by H / F)
    "F2-H4-tau1": (2, 4, 1, 0.3, 13, {0: [2, 6, 10], 1: [4, 8, 12]}),
    "F3-H6-tau2": (3, 6, 2, 0.6, 15, {0: [2, 8, 14], 1: [4, 10], 2: [6, 12]}),
    "F1-H3-tau2-alpha0": (1, 3, 2, 0.0, 10, {0: [3, 6, 9]}),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", sorted(CASES))
def test_fragments_delay_and_merge_follow_a_float64_loop(case: str) -> None:
    fragments, h, tau, alpha, steps, sends = CASES[case]
    got = run_world(_streaming, 2, fragments, h, tau, alpha, steps)
    want = _reference(fragments, h, tau, alpha, steps, sends)
    for rank in range(2):
        torch.testing.assert_close(got[rank], want[rank], rtol=1e-12, atol=1e-12)
    assert float((want[0] - want[1]).norm()) > 1e-3  # the workers differ: the merge kept some


def _schedule(rank: int, world: int) -> tuple[list[list[float]], list[list[int]]]:
    layers = [[torch.nn.Parameter(torch.full((1,), float(i)))] for i in range(7)]
    opt = StreamingDiLoCo(layers, torch.optim.SGD([p for (p,) in layers], lr=0.1), 6, fragments=3)
    opt.close()
    members = [[float(p) for p in frag] for frag in opt.fragments]
    return members, [[s for s in range(1, 20) if opt.sends_at(f, s)] for f in range(3)]


@pytest.mark.multiprocess
def test_fragments_are_strided_and_staggered() -> None:
    members, sends = run_world(_schedule, 2)[0]
    assert members == [[0.0, 3.0, 6.0], [1.0, 4.0], [2.0, 5.0]]  # layer i in fragment i mod 3
    assert sends == [[2, 8, 14], [4, 10, 16], [6, 12, 18]]  # every 6 steps, 6 / 3 apart


def _refused(rank: int, world: int) -> list[str]:
    layers = [[torch.nn.Parameter(torch.zeros(1))] for _ in range(3)]
    out = []
    for kw in (dict(fragments=4), dict(delay=4), dict(alpha=1.5), dict(bits=2)):
        try:
            StreamingDiLoCo(layers, torch.optim.SGD([p for (p,) in layers], lr=0.1), 4, **kw)
        except ValueError as e:
            out.append(str(e).split(" ")[0])
    return out


@pytest.mark.multiprocess
def test_bad_settings_are_refused() -> None:
    assert run_world(_refused, 2)[0] == ["fragments", "delay", "alpha", "bits"]


def _quantized(rank: int, world: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + rank)
    delta = torch.randn(3 * CHUNK + 5, generator=gen) * (rank + 1)
    layer = [torch.nn.Parameter(torch.zeros(3))]
    opt = StreamingDiLoCo([layer], torch.optim.SGD(layer, lr=0.1), 2, bits=bits)
    mean = opt._quantized_mean(delta.clone())
    opt.close()
    return delta, mean


@pytest.mark.multiprocess
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_exchange_is_the_same_mean_on_every_rank_within_its_error(bits: int) -> None:
    (d0, m0), (d1, m1) = run_world(_quantized, 2, bits)
    assert torch.equal(m0, m1)
    exact = (d0 + d1) / 2
    top = 2 ** (bits - 1) - 1
    # half a step per value of the first quantisation (each input's chunk scale) and of the
    # second (the mean's): the chunks of the padded vector
    pad = lambda v: torch.cat([v, v.new_zeros(-len(v) % (2 * CHUNK))]).view(-1, CHUNK)  # noqa: E731
    step = (pad(d0).abs().amax(1) + pad(d1).abs().amax(1)) / 2 / top
    step = step + (pad(exact).abs().amax(1) + step * top) / top
    bound = (step[:, None] / 2 * (1 + 1e-5)).expand(-1, CHUNK).reshape(-1)[: len(exact)]
    err = (m0 - exact).abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    assert float(err.max()) > 0  # it was quantised


def test_four_bit_codes_pack_two_per_byte_and_back() -> None:
    x = torch.linspace(-3, 5, 2 * CHUNK)
    codes, scale = quantize(x, 4)
    assert int(codes.abs().max()) == 7 and pack(codes, 4).numel() == CHUNK
    assert torch.equal(unpack(pack(codes, 4), 4), codes)
    assert float((dequantize(codes, scale) - x).abs().max()) <= float(scale.max()) / 2 + 1e-6

"""torchft 0.2.0's DiLoCo as the benchmark runs it (``benchmarks/_peers.py``), against ours.

2 gloo ranks on CPU, one torchft replica each (Lighthouse, Manager, ProcessGroupGloo), a small
float32 model with AdamW inner steps. What it shows about torchft as shipped: its plain DiLoCo
is ``benchmarks/_diloco.py`` bit for bit; its Streaming DiLoCo (fragments, delay, alpha) is the
paper's recipe of ``benchmarks/_streaming_diloco.py`` with one difference of schedule: torchft
launches a fragment's exchange ``tau`` steps *before* its offset and merges at the offset,
where the paper (and ours) launches at the offset and merges ``tau`` steps later. So with the
offsets moved ``tau`` steps earlier ours matches it (to rounding: torchft merges by ``lerp``).
With ``:hetero`` (a ``sync_every`` per replica, here 4 and 2) torchft counts each replica's own
steps and picks the fragment by the Manager's step: its DiLoCo is ours with the same per-rank H
bit for bit, and its streaming variant syncs the same fragment on both replicas in turn.
Skipped without torchft (a benchmark extra: ``pip install torchft==0.2.0``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from _harness import run_world_fresh

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(
        importlib.util.find_spec("torchft") is None,
        reason="torchft not installed (benchmark extra: pip install torchft==0.2.0)",
    ),
]


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _side_by_side(rank: int, world: int, h: int, f: int, tau: int, alpha: float) -> list[float]:
    import _peers
    from _diloco import DiLoCo
    from _streaming_diloco import StreamingDiLoCo

    torch.manual_seed(0)
    ours, theirs = _net(), _net()
    theirs.load_state_dict(ours.state_dict())
    inner = torch.optim.AdamW(ours.parameters(), lr=0.05)
    if f == 1 and tau == 0:
        mine = DiLoCo(ours.parameters(), inner, h)
    else:
        layers = [list(m.parameters()) for m in _peers.layer_modules(ours)]
        mine = StreamingDiLoCo(layers, inner, h, fragments=f, delay=tau, alpha=alpha)
        mine.offsets = [o - tau for o in mine.offsets]  # torchft's schedule (see above)
    m = {"kind": "torchft-sdiloco", "H": h, "F": f, "tau": tau, "alpha": alpha, "bits": None}
    ft_inner = torch.optim.AdamW(theirs.parameters(), lr=0.05)
    ft = _peers.TorchftDiLoCo(theirs, _peers.layer_modules(theirs), ft_inner, m, {})
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3 * h):
        x, y = torch.randn(16, 6, generator=gen), torch.randn(16, 3, generator=gen)
        for net, opt in ((ours, mine), (theirs, ft)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
    if hasattr(mine, "close"):
        mine.close()
    ft.close()
    return [float((a - b).abs().max()) for a, b in zip(ours.parameters(), theirs.parameters())]


CASES = [(4, 1, 0, 0.0), (4, 2, 1, 0.5), (6, 2, 2, 0.3)]  # H, fragments, tau, alpha


def _all_cases(rank: int, world: int) -> list[list[float]]:
    return [_side_by_side(rank, world, *case) for case in CASES]


@pytest.fixture(scope="module")
def diffs() -> list[list[list[float]]]:
    """Per rank, per case, per parameter: max |ours - torchft| (one fresh world for all)."""
    return run_world_fresh(_all_cases, 2, timeout=400)


def test_torchft_diloco_is_ours_bit_for_bit(diffs) -> None:
    for rank in diffs:
        assert rank[0] == [0.0] * 4


def test_torchft_streaming_diloco_is_the_papers_launched_tau_steps_early(diffs) -> None:
    for rank in diffs:
        for case in rank[1:]:
            assert max(case) < 1e-6, case


# -- :hetero: a sync_every per replica (round(H x speed)), torchft's answer to uneven devices ----
def _hetero(rank: int, world: int) -> dict:
    import _peers
    import methods
    from _diloco import DiLoCo

    out = {}
    for spec in ("torchft-diloco:H4:hetero", "torchft-sdiloco:H4:F2:hetero"):
        m = methods.parse(spec)
        h = methods.local_steps(m, "1,0.5", world)[rank]  # 4 and 2
        torch.manual_seed(0)
        ours, theirs = _net(), _net()
        theirs.load_state_dict(ours.state_dict())
        mine = DiLoCo(ours.parameters(), torch.optim.AdamW(ours.parameters(), lr=0.05), h)
        ft_inner = torch.optim.AdamW(theirs.parameters(), lr=0.05)
        ft = _peers.TorchftDiLoCo(theirs, _peers.layer_modules(theirs), ft_inner, {**m, "H": h}, {})  # fmt: skip
        gen = torch.Generator().manual_seed(rank)
        for _ in range(3 * h):  # three periods of this rank's own length: 3 x F syncs
            x, y = torch.randn(16, 6, generator=gen), torch.randn(16, 3, generator=gen)
            for net, opt in ((ours, mine), (theirs, ft)):
                opt.zero_grad()
                torch.nn.functional.mse_loss(net(x), y).backward()
                opt.step()
        out[spec] = {"h": h, "syncs": ft.manager.current_step(),
                     "theirs": [p.detach().clone() for p in theirs.parameters()],
                     "ours": [p.detach().clone() for p in ours.parameters()]}  # fmt: skip
        ft.close()
    return out


@pytest.fixture(scope="module")
def hetero() -> list[dict]:
    return run_world_fresh(_hetero, 2, timeout=400)


def test_torchft_diloco_hetero_syncs_after_each_replicas_own_steps(hetero) -> None:
    one, two = (r["torchft-diloco:H4:hetero"] for r in hetero)
    assert (one["h"], two["h"], one["syncs"], two["syncs"]) == (4, 2, 3, 3)
    for a, b, mine in zip(one["theirs"], two["theirs"], one["ours"]):
        assert torch.equal(a, b)  # after a sync: the same parameters on both replicas
        assert torch.equal(a, mine)  # and ours with the same per-rank H, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(two["theirs"], two["ours"]))


def test_torchft_streaming_diloco_hetero_syncs_the_same_fragment_in_turn(hetero) -> None:
    one, two = (r["torchft-sdiloco:H4:F2:hetero"] for r in hetero)
    assert (one["h"], two["h"], one["syncs"], two["syncs"]) == (4, 2, 6, 6)  # every H / F steps
    # the sixth sync was the second fragment's (the last Linear): the same on both replicas,
    # the first fragment's trained on since its sync
    assert all(torch.equal(a, b) for a, b in zip(one["theirs"][2:], two["theirs"][2:]))
    assert not torch.equal(one["theirs"][0], two["theirs"][0])

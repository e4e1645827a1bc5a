"""Which consensus step gamma keeps compressed gossip converging, per codec (no processes).

A float64 simulation of the recursion of :mod:`decent_optim.gossip.compressed` with the real
codecs: every group of a round is split by node into parts, every part has a public copy per
group, and a round is ``q_a = Q(m_a - copy_a); copy_a += q_a; x_i = m_a + gamma/p sum_b
(copy_b - copy_a)``. Prints the consensus distance ``|x - mean| / |x0 - mean0|`` after a number
of rounds (pure consensus, no gradients), and the largest drift of the mean.

    PYTHONPATH=$PWD python benchmarks/codec_gamma.py --rounds 1000 --numel 2048
"""

from __future__ import annotations

import argparse

import torch

from decent_optim import topologies
from decent_optim.gossip import codecs


def simulate(
    codec_name: str,
    topo_name: str,
    n: int,
    local: int,
    gamma: float,
    rounds: int,
    numel: int,
    seed: int = 0,
) -> tuple[float, float]:
    torch.manual_seed(seed)
    codec = codecs.get(codec_name)
    gamma = gamma if gamma > 0 else codec.gamma  # 0: the codec's own
    topo = topologies.get(topo_name, n, local)
    x = torch.randn(n, numel, dtype=torch.float64)
    mean0, dist0 = x.mean(0), (x - x.mean(0)).norm()
    copies: dict[tuple[int, ...], torch.Tensor] = {}  # per group: one copy per part
    drift = 0.0
    for r in range(rounds):
        new = x.clone()
        for group in topo.groups(r):
            nodes: dict[int, list[int]] = {}
            for m in group:
                nodes.setdefault(m // local, []).append(m)
            parts = [nodes[k] for k in sorted(nodes)]
            means = torch.stack([x[p].mean(0) for p in parts])
            if len(parts) == 1:  # inside a node: exact
                new[list(group)] = means[0]
                continue
            held = copies.get(group)
            if held is None:  # the first round sends exact values
                held = copies[group] = means.clone()
            else:
                for a in range(len(parts)):
                    payload = torch.empty(codec.nbytes(numel), dtype=torch.uint8)
                    codec.encode_(means[a], held[a], payload, absorb=True, seed=r * 64 + a)
            for a, part in enumerate(parts):
                step = (held - held[a]).sum(0) * (gamma / len(parts))
                new[part] = means[a] + step
        x = new
        drift = max(drift, (x.mean(0) - mean0).abs().max().item())
    return ((x - x.mean(0)).norm() / dist0).item(), drift


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=3000)
    p.add_argument("--numel", type=int, default=4096)
    p.add_argument("--codecs", nargs="+", default=["rand1%", "top1%+int2", "rand1%+int4"])
    p.add_argument(
        "--gammas", nargs="+", type=float, default=[0.0, 1.0], help="0: the codec's own gamma"
    )
    p.add_argument(
        "--settings",
        nargs="+",
        default=["ring:8:1", "ring:8:2", "complete:8:2"],
        help="topology:workers:workers per node",
    )
    args = p.parse_args()
    settings = [(t, int(n), int(local)) for t, n, local in (s.split(":") for s in args.settings)]
    for name in args.codecs:
        for topo, n, local in settings:
            row = []
            for gamma in args.gammas:
                dist, drift = simulate(name, topo, n, local, gamma, args.rounds, args.numel)
                used = gamma if gamma > 0 else codecs.get(name).gamma
                row.append(f"g={used:.3g}: {dist:.2e} (drift {drift:.0e})")
            print(f"{name:12s} {topo:12s} {n // local}x{local}  " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()

"""Draw the built-in topologies and tabulate their mixing rate and cost, from the package itself.

Run by ``conf.py`` at the start of every docs build (and runnable alone:
``python docs/topology_figures.py OUTDIR``). Writes into ``OUTDIR``:

* ``topology-<key>.png``: one panel per round of the period, an edge between two workers when
  they exchange values in that round;
* ``topology-table.rst.inc`` and ``gap-table.rst.inc``: tables included by ``topologies.rst``.

The numbers come from :class:`decent_optim.Topology` (``groups``, ``weights``, ``out_peers``,
``spectral_gap``), so the pages cannot drift from the code.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from decent_optim import topologies  # noqa: E402
from decent_optim.topologies import Topology  # noqa: E402

# (file key, title, topology)
FIGURES: list[tuple[str, str, Topology]] = [
    ("complete", "complete, n = 8", topologies.get("complete", 8)),
    ("ring", "ring, n = 8", topologies.get("ring", 8)),
    ("ring-odd", "ring, n = 5 (odd: one worker sits out each round)", topologies.get("ring", 5)),
    ("one-peer-exp", "one-peer-exp, n = 8", topologies.get("one-peer-exp", 8)),
    (
        "alternating-exp-ring",
        "alternating-exp-ring, 4 nodes x 2 workers",
        topologies.get("alternating-exp-ring", 8, 2),
    ),
    ("base-4", "base-4, n = 16", topologies.get("base-4", 16)),
]


NODE_COLORS = ["C0", "C1", "C2", "C4", "C6", "C8", "C9", "C5"]  # no red: red marks inter-node edges


def sent_per_round(topo: Topology, step: int) -> float:
    """Largest number of model-sized buffers one worker sends in round ``step``.

    Follows the ``"auto"`` transport of :class:`decent_optim.gossip.Gossiper`: a pair, or a
    round with arbitrary weights, is exchanged point to point (one buffer to each out-peer); a
    uniform group of ``k >= 3`` is all-reduced (a ring all-reduce sends ``2 (k - 1) / k``).
    """
    groups = topo.groups(step)
    if groups is None:
        return float(max(len(topo.out_peers(r, step)) for r in range(topo.world_size)))
    cost = 0.0
    for g in groups:
        k = len(g)
        cost = max(cost, 0.0 if k == 1 else 1.0 if k == 2 else 2 * (k - 1) / k)
    return cost


def rounds_for_tenfold(topo: Topology) -> str:
    """Rounds after which the spread around the mean is guaranteed to be 10x smaller."""
    sigma2 = 1.0 - topo.spectral_gap()
    if sigma2 <= 1e-12:
        return f"{topo.period} (exact average)"
    periods = math.ceil(math.log(0.1) / math.log(sigma2))
    return str(periods * topo.period)


def draw(topo: Topology, title: str, path: Path) -> None:
    n, period, local = topo.world_size, topo.period, topo.local_world_size
    angles = [math.pi / 2 - 2 * math.pi * i / n for i in range(n)]
    xy = [(math.cos(a), math.sin(a)) for a in angles]
    fig, axes = plt.subplots(1, period, figsize=(2.3 * period + 0.4, 2.7), squeeze=False)
    for r, ax in enumerate(axes[0]):
        for i in range(n):
            for j in topo.in_peers(i, r):
                if j < i:
                    continue
                across = local > 1 and i // local != j // local
                ax.plot(
                    [xy[i][0], xy[j][0]],
                    [xy[i][1], xy[j][1]],
                    color="C3" if across else "0.35",
                    lw=1.6 if across else 1.2,
                    zorder=1,
                )
        colors = [
            NODE_COLORS[(i // local) % len(NODE_COLORS)] if local > 1 else "C0" for i in range(n)
        ]
        ax.scatter([p[0] for p in xy], [p[1] for p in xy], s=260, c=colors, zorder=2)
        for i, (x, y) in enumerate(xy):
            ax.text(x, y, str(i), ha="center", va="center", color="white", fontsize=8, zorder=3)
        ax.set_title(f"round {r}", fontsize=9)
        ax.set_xlim(-1.3, 1.3)
        ax.set_ylim(-1.3, 1.3)
        ax.set_aspect("equal")
        ax.axis("off")
    note = "  (colour = node; red edges cross nodes)" if local > 1 else ""
    fig.suptitle(title + note, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _rst_table(header: list[str], rows: list[list[str]], widths: str) -> str:
    lines = [".. list-table::", "   :header-rows: 1", f"   :widths: {widths}", ""]
    for row in [header, *rows]:
        lines.append("   * - " + row[0])
        lines += [f"     - {cell}" for cell in row[1:]]
    return "\n".join(lines) + "\n"


def topology_table() -> str:
    rows = []
    for _key, title, topo in FIGURES:
        rounds = range(topo.period)
        peers = sorted({len(topo.in_peers(i, r)) for r in rounds for i in range(topo.world_size)})
        sent = sum(sent_per_round(topo, r) for r in rounds) / topo.period
        rows.append(
            [
                title.split(" (")[0],
                str(topo.period),
                f"{peers[0]}-{peers[-1]}" if len(peers) > 1 else str(peers[0]),
                f"{sent:.2f}",
                f"{topo.spectral_gap():.3f}",
                rounds_for_tenfold(topo),
            ]
        )
    header = [
        "topology",
        "period (rounds)",
        "peers per worker and round",
        "model sizes sent per worker and round (mean over the period)",
        "spectral gap of one period",
        "rounds for 10x closer agreement (bound)",
    ]
    return _rst_table(header, rows, "26 10 12 18 12 22")


def gap_table() -> str:
    sizes = [4, 8, 16, 32]
    specs = [
        ("complete", 1),
        ("ring", 1),
        ("one-peer-exp", 1),
        ("alternating-exp-ring", 2),
        ("base-4", 1),
    ]
    rows = []
    for name, local in specs:
        cells = []
        for n in sizes:
            topo = topologies.get(name, n, local)
            cells.append(f"{topo.spectral_gap():.3f} / {topo.period}")
        label = f"{name} (2 workers per node)" if local > 1 else name
        rows.append([label, *cells])
    header = ["topology", *[f"n = {n}" for n in sizes]]
    return _rst_table(header, rows, "32 17 17 17 17")


def generate(outdir: Path) -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    for key, title, topo in FIGURES:
        draw(topo, title, outdir / f"topology-{key}.png")
    (outdir / "topology-table.rst.inc").write_text(topology_table())
    (outdir / "gap-table.rst.inc").write_text(gap_table())


if __name__ == "__main__":
    generate(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/_generated"))

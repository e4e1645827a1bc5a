"""How far ``torch.compile(opt.step)`` leaves the eager step on gloo ranks (issue 26's repro).

Usage: ``python experiments/compile_drift.py DecentralizedAdamW inductor none 0.01`` (optimizer,
backend, compression or ``none``, learning rate; ``WS=4`` for four ranks). Each rank steps two
float32 parameters (40x30 and 7) four times with its own random gradients, eager and compiled,
on a ring; prints the largest difference between the two per rank, and between the ranks.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def job(rank, world_size, name, backend, compression, lr):
    import torch
    import torch._dynamo
    from torch import nn

    import decent_optim as dopt

    out = {}
    for mode in ("eager", "compiled"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(40, 30)), nn.Parameter(torch.randn(7))]
        opt = getattr(dopt, name)(
            params, lr=lr, topology="ring", compression=compression, local_world_size=1
        )
        step = opt.step if mode == "eager" else torch.compile(opt.step, backend=backend)
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(4):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            step()
        opt.synchronize()
        out[mode] = torch.cat([p.detach().flatten() for p in params])
    return out


if __name__ == "__main__":
    from _harness import run_world_fresh

    name, backend, compression, lr = sys.argv[1:5]
    results = run_world_fresh(
        job,
        int(os.environ.get("WS", "2")),
        name,
        backend,
        None if compression == "none" else compression,
        float(lr),
        timeout=600,
    )
    for rank, r in enumerate(results):
        print(
            f"rank {rank}: max |eager - compiled| = {(r['eager'] - r['compiled']).abs().max():.3g}"
        )
    first = results[0]["compiled"]
    print(
        "max |rank 0 - rank r| compiled:",
        [f"{(first - r['compiled']).abs().max():.3g}" for r in results],
    )

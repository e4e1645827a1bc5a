"""How close can a step's mix + AdamW update get to the memory bandwidth? One bucket, one process.

    python benchmarks/mix_kernel.py [--numel 6291456] [--threads 2]

Times, on one float32 bucket, round-robin (median ms and ratio to the first row):

* ``fused-adamw``: torch's fused AdamW kernel alone (7 words per element: the reference);
* ``sum+folded-adamw``: what ``DecentralizedAdamW`` does after a pair round, ``p += r`` and the
  fused kernel with the pair's 1/2 folded into its decay (3 + 7 words: about 1.43x);
* ``sliced``: the same two passes taken a slice at a time, so that ``p`` is still in cache for
  the second (``--slice`` elements);
* ``compiled``: ``torch.compile`` (inductor) of ``(p + r) * c`` followed by the AdamW math, one
  generated loop (8 words: about 1.14x); its compile time is printed first.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

LR, WD, BETAS, EPS, STEP = 1e-4, 0.01, (0.9, 0.999), 1e-8, 5


def mix_adamw_(p, r, g, m, v, scale, beta1, beta2, eps, step_size, bias2_sqrt):
    """x = (p + r) * factor, then AdamW on x; written for inductor to fuse into one loop.

    ``scale = factor * (1 - lr * wd)`` and ``step_size = lr / (1 - beta1**t)`` come computed:
    arithmetic between two float arguments inside the compiled function makes dynamo specialize
    on their values (torch 2.11 on CUDA recompiled at every step on the bias correction).
    """
    x = (p + r) * scale
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    p.copy_(x - step_size * m / (v.sqrt() / bias2_sqrt + eps))


def mix_adamw_scalars(factor, lr, wd, betas, eps, step):
    """The scalar arguments of :func:`mix_adamw_` after ``p``, ``r``, ``g``, ``m``, ``v``."""
    beta1, beta2 = betas
    bias1, bias2_sqrt = 1 - beta1**step, (1 - beta2**step) ** 0.5
    return (factor * (1 - lr * wd), beta1, beta2, eps, lr / bias1, bias2_sqrt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=6_291_456)  # the benchmark's largest bucket
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--slice", type=int, default=1 << 20)
    parser.add_argument("--iters", type=int, default=40)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    p, r, g, m = (torch.randn(args.numel, generator=gen) for _ in range(4))
    v = torch.rand(args.numel, generator=gen)
    step = torch.tensor(float(STEP))
    folded = (1 - 0.5 * (1 - LR * WD)) / LR  # decent_optim.rules.base.folded_decay(0.5, LR, WD)

    def adamw(params, grads, ms, vs, wd):
        torch._fused_adamw_(
            params, grads, ms, vs, [], [step] * len(params), lr=LR, beta1=BETAS[0],
            beta2=BETAS[1], weight_decay=wd, eps=EPS, amsgrad=False, maximize=False,
        )  # fmt: skip

    def sliced() -> None:
        for a in range(0, args.numel, args.slice):
            b = a + args.slice
            p[a:b].add_(r[a:b])
            adamw([p[a:b]], [g[a:b]], [m[a:b]], [v[a:b]], folded)

    compiled = torch.compile(mix_adamw_)
    hyper = mix_adamw_scalars(0.5, LR, WD, BETAS, EPS, STEP)
    start = time.perf_counter()
    compiled(p, r, g, m, v, *hyper)
    print(f"compile: {time.perf_counter() - start:.1f} s")
    methods = {
        "fused-adamw": lambda: adamw([p], [g], [m], [v], WD),
        "sum+folded-adamw": lambda: (p.add_(r), adamw([p], [g], [m], [v], folded)),
        "sliced": sliced,
        "compiled": lambda: compiled(p, r, g, m, v, *hyper),
    }
    samples: dict[str, list[float]] = {k: [] for k in methods}
    for it in range(args.iters + 5):
        for name, run in methods.items():  # round robin: background load hits all alike
            p.mul_(0.5)  # keep the values bounded (p += r every call); not timed
            t0 = time.perf_counter()
            run()
            if it >= 5:
                samples[name].append(time.perf_counter() - t0)
    base = statistics.median(samples["fused-adamw"])
    print(f"{args.numel:,} float32 elements, {torch.get_num_threads()} threads")
    print("| method | ms | vs fused-adamw |")
    print("|---|---:|---:|")
    for name, times in samples.items():
        t = statistics.median(times)
        print(f"| {name} | {t * 1e3:.2f} | {t / base:.2f}x |")


if __name__ == "__main__":
    main()

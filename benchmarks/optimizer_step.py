"""Time of one optimizer step in one process: decent_optim vs its torch.optim counterpart.

    python benchmarks/optimizer_step.py                          # CPU: many-small, few-large
    python benchmarks/optimizer_step.py --device cuda --shapes gpt-125m gpt-1.3b

Shape sets: ``shape_sets.py``. Methods (float32 parameters, gradients given):
``torch-foreach`` / ``torch-fused`` (``torch.optim.AdamW(foreach=True)`` / ``(fused=True)``);
``decent-update`` (``DecentralizedAdamW.step()``, one worker: the local update only);
``decent-step`` (mix + update over the loopback gossip of ``_loopback.py``, which hands each
bucket a real received buffer as a pair round does: the arithmetic of a step without network);
``decent-step-compiled``, a one-pass candidate that is not the library's path: ``torch.compile``
(``--compile-backend``; a Triton kernel on GPUs) of :func:`mix_kernel.mix_adamw_`, reading p, the
peer's values, g, m, v and writing p, m, v once (32 bytes per parameter instead of 40), on
gradients that are views of one buffer per bucket, so that one call steps a bucket;
``torch-sgd-fused`` / ``dsgd-update`` / ``dsgd-step`` (SGD and ``DSGD``, momentum 0.9);
``accum-update`` / ``accum-step`` (``AccumAdamW(accum_iter=4)`` against torch's fused AdamW;
its update is compiled, one pass reading the peer's values, for buckets from 2**20 elements).

Effective bandwidth counts the bytes a step must move per float32 parameter: AdamW reads p, g,
m, v and writes p, m, v (28 bytes); SGD with momentum 20; AccumAdam at least 28; the mix adds a
read of p and of the received copy and a write of p (12 more; 4 for the one-pass kernel).
``vs torch`` is the ratio to the median of the torch counterpart named in ``reference``; ``of
copy`` the effective bandwidth over that of a device-to-device copy of as many words, measured
in the same run. On CPUs the methods run interleaved round-robin, so machine load hits all
alike; on a GPU (or ``--one-at-a-time``) one after the other, so that memory holds one method's
tensors at a time (a 1.3B set), timed with CUDA events, with each one's peak memory. Results:
``--out`` (default ``benchmarks/results/``), ``optimizer_step.{json,md}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch
from _loopback import loop_back
from mix_kernel import mix_adamw_, mix_adamw_scalars
from shape_sets import NAMES, shapes

import decent_optim as dopt
from decent_optim.rules.adam import AdamRule

RESULTS = Path(__file__).resolve().parent / "results"

ADAMW = dict(lr=1e-4, weight_decay=0.01)
SGD = dict(lr=1e-3, momentum=0.9, weight_decay=1e-4)

# method -> (bytes moved per parameter, torch reference method)
METHODS = {
    "torch-foreach": (28, "torch-fused"),
    "torch-fused": (28, "torch-fused"),
    "decent-update": (28, "torch-fused"),
    "decent-step": (40, "torch-fused"),
    "decent-step-compiled": (32, "torch-fused"),
    "accum-update": (28, "torch-fused"),
    "accum-step": (40, "torch-fused"),
    "torch-sgd-fused": (20, "torch-sgd-fused"),
    "dsgd-update": (20, "torch-sgd-fused"),
    "dsgd-step": (32, "torch-sgd-fused"),
}
#: (numerator, denominator, limit) of the targets of issue 24, per shape set
TARGETS = [
    ("decent-update", "torch-fused", 1.05),
    ("decent-step", "torch-fused", 1.2),
    ("decent-step-compiled", "torch-fused", 1.2),
    ("accum-step", "decent-step", 1.1),
]


class _OnePassAdamRule(AdamRule):
    """AdamW whose update adds the peer's values and steps in one compiled pass per bucket."""

    def __init__(self, backend: str) -> None:
        self.kernel = torch.compile(mix_adamw_, dynamic=True, backend=backend)

    def flatten(self, bucket, group) -> bool:
        return False  # the kernel reads the peer's values itself: no gradient gathering first

    def update(self, batch, group, *, mix, amp) -> None:
        plain = group["amsgrad"] or group["maximize"] or not group["decoupled_weight_decay"]
        if mix.addend is None or amp.active or plain or batch.step is None or not batch.whole:
            super().update(batch, group, mix=mix, amp=amp)
            return
        batch.advance_steps()
        hyper = mix_adamw_scalars(
            mix.factor, group["lr"], group["weight_decay"], group["betas"], group["eps"],
            batch.step + 1,
        )  # fmt: skip
        bucket = batch.bucket
        m, v = bucket.state("exp_avg")[0], bucket.state("exp_avg_sq")[0]
        grad = _flat_grad(bucket, batch.grads)
        if grad is not None:  # the gradients are views of one buffer: one call for the bucket
            self.kernel(bucket.data, mix.addend, grad, m, v, *hyper)
            return
        for p, g, r, ms, vs in zip(
            bucket.params, batch.grads, *(bucket.segments(t) for t in (mix.addend, m, v))
        ):
            at = (p.data_ptr() - bucket.data.data_ptr()) // p.element_size()
            self.kernel(bucket.data[at : at + p.numel()], r, g.reshape(-1), ms, vs, *hyper)


def _flat_grad(bucket, grads) -> torch.Tensor | None:
    """The buffer the gradients are views of, laid out like the bucket, or None."""
    first = grads[0]
    base = first.data_ptr() - (bucket.params[0].data_ptr() - bucket.data.data_ptr())
    for p, g in zip(bucket.params, grads):
        if (
            g.stride() != p.stride()
            or g.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
        ):
            return None
        if g.data_ptr() - base != p.data_ptr() - bucket.data.data_ptr():
            return None
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(
        first.untyped_storage(), (base - first.untyped_storage().data_ptr()) // first.element_size(),
        (bucket.numel,), (1,),
    )  # fmt: skip


def make(method: str, params: list[torch.Tensor], backend: str):
    if method == "torch-foreach":
        return torch.optim.AdamW(params, foreach=True, **ADAMW)
    if method == "torch-fused":
        return torch.optim.AdamW(params, fused=True, **ADAMW)
    if method == "torch-sgd-fused":
        return torch.optim.SGD(params, fused=True, **SGD)
    if method == "decent-step-compiled":
        one_pass = type("OnePassAdamW", (dopt.DecentralizedAdamW,), {})
        one_pass.rule = _OnePassAdamRule(backend)
        opt = one_pass(params, **ADAMW)
        for bucket in opt._flat.buckets:  # gradients as views of one buffer per bucket
            flat = torch.empty_like(bucket.data)
            for p, view in zip(bucket.params, bucket.views(flat)):
                view.copy_(p.grad)
                p.grad = view
    elif method.startswith("decent"):
        opt = dopt.DecentralizedAdamW(params, **ADAMW)
    elif method.startswith("accum"):
        opt = dopt.AccumAdamW(params, accum_iter=4, **ADAMW)
    else:
        opt = dopt.DSGD(params, **SGD)
    if "-step" in method:
        loop_back(opt)
    return opt


def _tensors(shape_name: str, device: str) -> list[torch.Tensor]:
    gen = torch.Generator(device).manual_seed(0)
    params = []
    for s in shapes(shape_name):
        p = torch.randn(s, generator=gen, device=device).requires_grad_()
        p.grad = torch.randn(s, generator=gen, device=device)
        params.append(p)
    return params


def _timed(fn, device: str) -> float:
    """Seconds ``fn()`` took: CUDA events on a GPU, the wall clock on a CPU."""
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def copy_bandwidth(numel: int, device: str, iters: int) -> float:
    """GB/s of a device-to-device copy of ``numel`` float32 words (bytes read + written)."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    times = [_timed(lambda: dst.copy_(src), device) for _ in range(iters + 3)][3:]
    return 2 * 4 * numel / statistics.median(times) / 1e9


def run(
    shape_name: str,
    device: str,
    iters: int,
    warmup: int,
    methods: list[str],
    backend: str,
    one_at_a_time: bool,
):
    cuda = device.startswith("cuda")
    samples: dict[str, list[float]] = {m: [] for m in methods}
    peak: dict[str, float] = {}
    if one_at_a_time:  # each method's tensors alone in memory (a 1.3B set on one GPU)
        for m in methods:
            gc.collect()  # the last method's optimizer may sit in reference cycles
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            opt = make(m, _tensors(shape_name, device), backend)
            for it in range(warmup + iters):
                t = _timed(opt.step, device)
                if it >= warmup:
                    samples[m].append(t)
            if cuda:
                peak[m] = torch.cuda.max_memory_allocated() / 1e9
            del opt
        gc.collect()
    else:  # round robin: background load affects every method alike
        setups = {m: make(m, _tensors(shape_name, device), backend) for m in methods}
        for it in range(warmup + iters):
            for m in methods:
                t = _timed(setups[m].step, device)
                if it >= warmup:
                    samples[m].append(t)
        del setups
    numel = sum(torch.Size(s).numel() for s in shapes(shape_name))
    copy = copy_bandwidth(numel, device, iters)
    rows = []
    for m in methods:
        t = statistics.median(samples[m])
        nbytes, ref = METHODS[m]
        ref_t = statistics.median(samples[ref]) if ref in samples else float("nan")
        rows.append({
            "shape": shape_name, "method": m, "tensors": len(shapes(shape_name)), "params": numel,
            "median_ms": t * 1e3, "GB_per_s": numel * nbytes / t / 1e9, "reference": ref,
            "vs_torch": t / ref_t, "copy_GB_per_s": copy, "of_copy": numel * nbytes / t / 1e9 / copy,
            "peak_GB": peak.get(m, float("nan")),
        })  # fmt: skip
    return rows


def targets(rows: list[dict]) -> list[str]:
    """Markdown rows of the issue's targets that these rows can answer."""
    by = {(r["shape"], r["method"]): r["median_ms"] for r in rows}
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for num, den, limit in TARGETS:
            if (shape, num) in by and (shape, den) in by:
                ratio = by[(shape, num)] / by[(shape, den)]
                status = "met" if ratio <= limit else "**missed**"
                out.append(f"| {shape} | {num} / {den} <= {limit} | {ratio:.2f}x | {status} |")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)"
    )
    p.add_argument("--shapes", nargs="+", default=["many-small", "few-large"], choices=NAMES)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--compile-backend", default="inductor", help="for decent-step-compiled")
    p.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="time the methods one after the other, not interleaved (always on a GPU)",
    )
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    where = args.device
    if args.device.startswith("cuda"):
        where = f"{args.device} ({torch.cuda.get_device_name()})"
    rows = []
    for s in args.shapes:
        print(f"[optimizer_step] {s} ...", flush=True)
        sequential = args.one_at_a_time or args.device.startswith("cuda")
        rows += run(
            s, args.device, args.iters, args.warmup, args.methods, args.compile_backend, sequential
        )
    lines = [
        f"optimizer step, one process, {where}, {torch.get_num_threads()} threads, "
        f"median of {args.iters} steps (torch {torch.__version__})",
        "",
        "| shape | tensors | params | method | ms / step | effective GB/s | of copy | vs torch "
        "| peak GB |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['tensors']} | {r['params'] / 1e6:.1f}M | {r['method']} | "
            f"{r['median_ms']:.2f} | {r['GB_per_s']:.1f} | {r['of_copy']:.0%} | "
            f"{r['vs_torch']:.2f}x | {r['peak_GB']:.2f} |"
        )
    copies = {r["shape"]: r["copy_GB_per_s"] for r in rows}
    lines += ["", "device-to-device copy (read + write): " + ", ".join(
        f"{s} {gbs:.1f} GB/s" for s, gbs in copies.items())]  # fmt: skip
    checks = targets(rows)
    if checks:
        lines += ["", "| shape | target | measured | status |", "|---|---|---:|---|", *checks]
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "optimizer_step.json").write_text(
        json.dumps({"device": where, "torch": torch.__version__, "rows": rows}, indent=2)
    )
    (out / "optimizer_step.md").write_text(table + "\n")


if __name__ == "__main__":
    main()

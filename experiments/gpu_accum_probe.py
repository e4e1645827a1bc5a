"""AccumAdam's compiled update on a GPU: recompiles under changing scalars, and calls per bucket.

    python experiments/gpu_accum_probe.py [--shapes gpt-125m gpt-1.3b] [--iters 30]

Prints (markdown) what issue 34's first GPU check left open:

1. graphs compiled over 12 steps whose learning rate changes every step, for the kernel as it
   is (the caller computes every changing scalar) and with the rate passed in and multiplied by
   the decay inside (the form before the fix);
2. the host time of one compiled call on a tiny tensor (the per-call overhead);
3. the median step time of the variants in ``VARIANTS`` (one process; ``-step`` ones with the
   loopback gossip of ``benchmarks/_loopback.py``, a pair round's arithmetic): AccumAdamW
   (``accum_iter=4``) with the compiled kernel called once per parameter (the CUDA path before
   the fix) or once per flat bucket of 25 (the default), 100 or 400 MB, the eager sliced path
   (``fused=False``) at 2**22 and 2**18 elements per slice, and the one-pass AdamW candidate of
   ``benchmarks/mix_kernel.py``, beside ``torch.optim.AdamW(fused=True)``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
import torch._dynamo

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from _loopback import loop_back  # noqa: E402
from optimizer_step import _OnePassAdamRule, _tensors, _timed  # noqa: E402

import decent_optim as dopt  # noqa: E402
from decent_optim.rules import accum_adam  # noqa: E402
from decent_optim.rules.accum_adam import AccumAdamRule, accum_adam_math_  # noqa: E402


def _old_form(param, grad, m, v, acc, vmax, addend, *, lr, weight_decay, **kw):
    """The kernel's argument form before the fix: ``1 - lr * weight_decay`` computed inside."""
    accum_adam_math_(
        param, grad, m, v, acc, vmax, addend, weight_decay=weight_decay,
        decay=1 - lr * weight_decay, **kw,
    )  # fmt: skip


def recompiles(device: str) -> list[str]:
    out = []
    n = 1 << 20
    for name, fn, form in (("fixed", accum_adam_math_, "decay"), ("before", _old_form, "lr")):
        torch._dynamo.reset()
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        compiled = torch.compile(fn, dynamic=True)
        p, g, m, v, a = (torch.randn(n, device=device) for _ in range(5))
        v = v.abs()
        for t in range(1, 13):
            lr = 0.01 / t
            rate = {"decay": 1 - lr * 0.1} if form == "decay" else {"lr": lr}
            compiled(
                p, g, m, v, a, None, None, factor=1.0, decoupled=True, weight_decay=0.1,
                grad_factor=1.0, beta1=0.9, beta2=0.999, eps=1e-8, step_size=lr / (1 - 0.9**t),
                bias2_rsqrt=(1 - 0.999**t) ** -0.5, inv_s=0.25, refresh=t % 4 == 0, **rate,
            )  # fmt: skip
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
        out.append(f"| {name} | {graphs} |")
    return out


class _PerParameter(AccumAdamRule):
    def flatten(self, bucket, group) -> bool:  # the CUDA path before the fix
        if not self._compiles(bucket, group):
            return True
        return bucket.numel < (1 << 16) * len(bucket.params)


#: variant -> (optimizer, step with a loopback gossip, extra keyword arguments)
VARIANTS = {
    "torch-fused": ("torch", False, {}),
    "per-parameter": ("accum-per-parameter", False, {}),
    "flat": ("accum", False, {}),
    "flat-100mb": ("accum", False, {"bucket_cap_mb": 100}),
    "flat-400mb": ("accum", False, {"bucket_cap_mb": 400}),
    "eager-sliced": ("accum", False, {"fused": False}),
    "eager-sliced-2^18": ("accum", False, {"fused": False}),
    "accum-step": ("accum", True, {}),
    "accum-step-100mb": ("accum", True, {"bucket_cap_mb": 100}),
    "decent-step": ("decent", True, {}),
    "decent-step-compiled": ("compiled", True, {}),
    "decent-step-compiled-100mb": ("compiled", True, {"bucket_cap_mb": 100}),
}


def _make(variant: str, params):
    kind, step, extra = VARIANTS[variant]
    if kind == "torch":
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
    kwargs = dict(lr=1e-4, weight_decay=0.01, **extra)
    if kind == "accum-per-parameter":
        cls = type("PerParameter", (dopt.AccumAdamW,), {"rule": _PerParameter()})
        opt = cls(params, accum_iter=4, **kwargs)
    elif kind == "accum":
        opt = dopt.AccumAdamW(params, accum_iter=4, **kwargs)
    elif kind == "decent":
        opt = dopt.DecentralizedAdamW(params, **kwargs)
    else:
        one_pass = type("OnePassAdamW", (dopt.DecentralizedAdamW,), {})
        one_pass.rule = _OnePassAdamRule("inductor")
        opt = one_pass(params, **kwargs)
        for bucket in opt._flat.buckets:  # gradients as views of one buffer per bucket
            flat = torch.empty_like(bucket.data)
            for p, view in zip(bucket.params, bucket.views(flat)):
                view.copy_(p.grad)
                p.grad = view
    if step:
        loop_back(opt)
    return opt


def timings(shape: str, device: str, iters: int, variants: list[str]) -> list[str]:
    rows, base = [], None
    for variant in variants:
        gc.collect()  # the last optimizer may sit in reference cycles
        torch.cuda.empty_cache()
        accum_adam.SLICE["cuda"] = 1 << 18 if variant == "eager-sliced-2^18" else 1 << 22
        opt = _make(variant, _tensors(shape, device))
        times = [_timed(opt.step, device) for _ in range(iters + 5)][5:]
        ms = statistics.median(times) * 1e3
        base = base or ms
        rows.append(f"| {shape} | {variant} | {ms:.2f} | {ms / base:.2f}x |")
        del opt
    accum_adam.SLICE["cuda"] = 1 << 22
    return rows


def call_overhead(device: str) -> str:
    torch._dynamo.reset()
    compiled = torch.compile(accum_adam_math_, dynamic=True)
    p, g, m, v, a = (torch.randn(1024, device=device) for _ in range(5))
    kw = dict(
        factor=1.0, decoupled=True, weight_decay=0.1, decay=0.99, grad_factor=1.0, beta1=0.9,
        beta2=0.999, eps=1e-8, step_size=0.01, bias2_rsqrt=1.0, inv_s=0.25, refresh=False,
    )  # fmt: skip
    for _ in range(5):
        compiled(p, g, m, v.abs(), a, None, None, **kw)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        compiled(p, g, m, v, a, None, None, **kw)
    host = (time.perf_counter() - start) / 200
    torch.cuda.synchronize()
    return f"host time of one compiled call on 1024 elements: {host * 1e6:.0f} us"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["gpt-125m", "gpt-1.3b"])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    device = "cuda"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| kernel form | graphs over 12 steps of a changing rate |\n|---|---:|")
    print("\n".join(recompiles(device)), flush=True)
    print("\n" + call_overhead(device), flush=True)
    print("\n| shape | variant | ms | vs fused AdamW |\n|---|---|---:|---:|")
    for shape in args.shapes:
        print("\n".join(timings(shape, device, args.iters, args.variants)), flush=True)


if __name__ == "__main__":
    main()

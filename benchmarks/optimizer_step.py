"""Time of one optimizer step in one process: decent_optim vs its torch.optim counterpart.

    python benchmarks/optimizer_step.py                 # CPU; --device cuda on a GPU

Two model shapes: ``many-small`` (hundreds of small tensors) and ``few-large`` (a few large
ones, 10M+ parameters). Methods, run interleaved round-robin so machine load hits all alike:

* ``torch-foreach`` / ``torch-fused``: ``torch.optim.AdamW(foreach=True)`` / ``(fused=True)``;
* ``decent-update``: ``DecentralizedAdamW.step()`` with one worker (the local update only);
* ``decent-step``: the full step, mix + update: the optimizer's gossip is replaced by a loopback
  that hands each bucket a fixed "received" copy the way a ring round does (the peer's values
  and the weight 1/2 are left to the update), and lends a receive-sized buffer as the real
  gossip does, so it times the arithmetic of a step without the network;
* ``decent-step-compiled``: the same full step with the mix and the AdamW update in one compiled
  loop (``torch.compile`` of :func:`mix_kernel.mix_adamw_`, per parameter on its slice of the
  bucket; a one-pass step moves 32 bytes per parameter instead of 40); not the library's path
  (see the README: on this CPU inductor's loop is slower than the two passes of torch's kernels);
* ``torch-sgd-fused`` / ``dsgd-update`` / ``dsgd-step``: the same for ``torch.optim.SGD(fused=True)``
  and ``DSGD``, both with momentum 0.9 (the mix factor cannot join a momentum update);
* ``accum-update`` / ``accum-step``: ``AccumAdamW(accum_iter=4)``, compared with torch's fused
  AdamW (AccumAdam has no torch counterpart; with ``accum_iter=1`` it is Adam).

Effective bandwidth counts the bytes a step must move per float32 parameter: AdamW reads p, g,
m, v and writes p, m, v (28 bytes); SGD with momentum reads p, g, b and writes p, b (20);
AccumAdam at least reads p, g, m, v, the accumulator and writes p and the accumulator (28); the
mix adds a read of p and of the received copy and a write of p (12 more). ``vs torch`` is the
ratio to the median of the torch counterpart named in ``reference`` (its fused kernel).
Results go to ``benchmarks/results/optimizer_step.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from mix_kernel import mix_adamw_

import decent_optim as dopt
from decent_optim.gossip import GossipHandle, PendingMix
from decent_optim.rules.adam import AdamRule
from decent_optim.rules.compiled import CompiledStep

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


def shapes(name: str) -> list[tuple[int, ...]]:
    if name == "many-small":  # ~ 600 tensors, 2.4M parameters: biases, norms, small matrices
        out: list[tuple[int, ...]] = []
        for _ in range(150):
            out += [(64, 128), (128,), (128, 64), (64,)]
        return out
    if name == "few-large":  # 4 tensors, 10.5M parameters
        return [(2048, 2048), (2048, 1024), (1024, 2048), (1024, 2048)]
    raise ValueError(name)


class _Loopback:
    """A gossiper whose round mixes each buffer with a stored copy: the math of a pair round."""

    rank, world_size = 0, 1

    def __init__(self) -> None:
        self.received: list[torch.Tensor] | None = None
        self.receive_buffers: dict[int, torch.Tensor] = {}

    def start(self, buffers, step, **kwargs) -> GossipHandle:  # kwargs: global_average
        if self.received is None:
            self.received = [b.clone() for b in buffers]
        received = self.received

        def finish(defer_addend: bool) -> list[PendingMix]:
            if defer_addend:  # what Gossiper leaves after a pair round
                return [PendingMix(0.5, other) for other in received]
            for buf, other in zip(buffers, received):
                buf.add_(other)
            return [PendingMix(0.5)] * len(buffers)

        return GossipHandle([], finish, buffers=buffers)

    def idle_buffer(self, index: int, like: torch.Tensor) -> torch.Tensor:
        # Gossiper lends the bucket's receive buffer; here a buffer of the same size stands in
        # (the stored copy must stay as it is for the next round)
        if index not in self.receive_buffers:
            self.receive_buffers[index] = torch.empty_like(like)
        return self.receive_buffers[index]


class _OnePassAdamRule(AdamRule):
    """AdamW whose update adds the peer's values and steps in one compiled loop per parameter."""

    def __init__(self) -> None:
        self.kernel = CompiledStep(mix_adamw_)

    def update(self, batch, group, *, mix, amp) -> None:
        plain = group["amsgrad"] or group["maximize"] or not group["decoupled_weight_decay"]
        if mix.addend is None or amp.active or plain or batch.step is None:
            super().update(batch, group, mix=mix, amp=amp)
            return
        batch.advance_steps()
        (beta1, beta2), t = group["betas"], batch.step + 1
        bias = (1 - beta1**t, (1 - beta2**t) ** 0.5)
        hyper = (mix.factor, group["lr"], group["weight_decay"], beta1, beta2, group["eps"], *bias)
        base = batch.bucket.data
        for k, p in enumerate(batch.params):
            at = (p.data_ptr() - base.data_ptr()) // p.element_size()
            r = mix.addend[at : at + p.numel()]
            m, v = batch.state["exp_avg"][k], batch.state["exp_avg_sq"][k]
            args = (p.view(-1), r, batch.grads[k].view(-1), m.view(-1), v.view(-1), *hyper)
            if not self.kernel.run(p.device, *args):
                raise SystemExit("decent-step-compiled: torch.compile failed on this machine")


class _OnePassAdamW(dopt.DecentralizedAdamW):
    rule = _OnePassAdamRule()


def make(method: str, params: list[torch.Tensor]):
    if method == "torch-foreach":
        return torch.optim.AdamW(params, foreach=True, **ADAMW)
    if method == "torch-fused":
        return torch.optim.AdamW(params, fused=True, **ADAMW)
    if method == "torch-sgd-fused":
        return torch.optim.SGD(params, fused=True, **SGD)
    if method == "decent-step-compiled":
        opt = _OnePassAdamW(params, **ADAMW)
    elif method.startswith("decent"):
        opt = dopt.DecentralizedAdamW(params, **ADAMW)
    elif method.startswith("accum"):
        opt = dopt.AccumAdamW(params, accum_iter=4, **ADAMW)
    else:
        opt = dopt.DSGD(params, **SGD)
    if "-step" in method:
        opt._rounds.gossip = _Loopback()  # type: ignore[assignment]
    return opt


def run(shape_name: str, device: str, iters: int, warmup: int, methods: list[str]) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    setups = {}
    for m in methods:
        params = [
            torch.randn(s, generator=gen).to(device).requires_grad_() for s in shapes(shape_name)
        ]
        grads = [torch.randn(s, generator=gen).to(device) for s in shapes(shape_name)]
        for p, g in zip(params, grads):
            p.grad = g
        setups[m] = make(m, params)
    numel = sum(p.numel() for p in setups[methods[0]].param_groups[0]["params"])
    samples: dict[str, list[float]] = {m: [] for m in methods}
    for it in range(warmup + iters):
        for m in methods:  # round robin: background load affects every method alike
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            setups[m].step()
            if device == "cuda":
                torch.cuda.synchronize()
            if it >= warmup:
                samples[m].append(time.perf_counter() - t0)
    rows = []
    for m in methods:
        t = statistics.median(samples[m])
        nbytes, ref = METHODS[m]
        ref_t = statistics.median(samples[ref]) if ref in samples else float("nan")
        rows.append({
            "shape": shape_name, "method": m, "tensors": len(shapes(shape_name)), "params": numel,
            "median_ms": t * 1e3, "GB_per_s": numel * nbytes / t / 1e9, "reference": ref,
            "vs_torch": t / ref_t,
        })  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)"
    )
    p.add_argument("--shapes", nargs="+", default=["many-small", "few-large"])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for s in args.shapes:
        print(f"[optimizer_step] {s} ...", flush=True)
        rows += run(s, args.device, args.iters, args.warmup, args.methods)
    lines = [
        f"optimizer step, one process, {args.device}, {torch.get_num_threads()} threads, "
        f"median of {args.iters} steps (torch {torch.__version__})",
        "",
        "| shape | tensors | params | method | ms / step | effective GB/s | vs torch |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['tensors']} | {r['params'] / 1e6:.1f}M | {r['method']} | "
            f"{r['median_ms']:.2f} | {r['GB_per_s']:.1f} | {r['vs_torch']:.2f}x |"
        )
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "optimizer_step.json").write_text(
        json.dumps({"device": args.device, "rows": rows}, indent=2)
    )
    (out / "optimizer_step.md").write_text(table + "\n")


if __name__ == "__main__":
    main()

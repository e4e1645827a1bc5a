"""What a gossip codec costs on a device: encode (with the sender's absorb) and decode, per round.

For every codec, a flat float32 buffer of ``--numel`` elements (the parameters of one model
copy): ``encode_(a, b, payload, absorb=True)`` then ``decode_add_(payload, out)``, the work a
sender and one receiver do per round. Median of ``--iters`` after ``--warmup``, timed with CUDA
events on a GPU. Beside each time: the payload's bytes per element and, on a GPU, whether the
payload and the decoded sum equal those of the CPU on the first ``--check`` elements (the same
arithmetic; the random positions come from a CPU generator on every device).

    PYTHONPATH=$PWD python benchmarks/codec_speed.py --device cuda --numel 124000000
    PYTHONPATH=$PWD python benchmarks/codec_speed.py --device cpu --numel 1000000 --iters 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from decent_optim.gossip import codec_base, codecs

CODECS = [
    "bf16", "int8", "int4", "int2", "rand1%", "top1%", "rand1%+int4", "rand0.3%+int2",
    "top1%+int2", "top0.3%+int2",
]  # fmt: skip


def median_ms(device: torch.device, fn, iters: int, warmup: int) -> float:
    """Median milliseconds of ``fn()`` on ``device`` after ``warmup`` calls (CUDA events on a
    GPU, so that the host's launch queue does not count)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _round(name: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sender's payload of ``a - b`` (seed 7) and what a receiver adds to zeros."""
    codec = codecs.get(name)
    payload = torch.empty(codec.nbytes(a.numel()), dtype=torch.uint8, device=a.device)
    codec.encode_(a, b.clone(), payload, absorb=True, seed=7)
    out = torch.zeros_like(a)
    codec.decode_add_(payload, out)
    return payload, out


def measure(name: str, device: torch.device, numel: int, iters: int, warmup: int, check: int):
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(numel, generator=gen).to(device)
    b = a + 0.01 * torch.randn(numel, generator=gen).to(device)
    codec = codecs.get(name)
    payload = torch.empty(codec.nbytes(numel), dtype=torch.uint8, device=device)
    public, out = b.clone(), torch.zeros_like(a)
    seeds = iter(range(10**9))

    def encode():
        codec.encode_(a, public, payload, absorb=True, seed=next(seeds))

    def decode():
        codec.decode_add_(payload, out)

    row = {
        "codec": name,
        "device": device.type,
        "numel": numel,
        "bytes_per_element": codec.nbytes(numel) / numel,
        "encode_ms": median_ms(device, encode, iters, warmup),
        "decode_ms": median_ms(device, decode, iters, warmup),
    }
    if device.type != "cpu" and check > 0:
        n = max(codecs.CHUNK, min(check, numel) // codecs.CHUNK * codecs.CHUNK)
        here = [t.cpu() for t in _round(name, a[:n], b[:n])]
        there = _round(name, a[:n].cpu(), b[:n].cpu())
        row["payload_equal_cpu"] = bool(torch.equal(here[0], there[0]))
        row["decoded_max_abs_diff_cpu"] = float((here[1] - there[1]).abs().max())
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--numel", type=int, nargs="+", default=[124_000_000])
    ap.add_argument("--codecs", nargs="+", default=CODECS)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--check", type=int, default=1 << 22, help="elements compared with the CPU (0: none)"
    )
    ap.add_argument(
        "--slice", type=int, help="elements per slice off the CPU (default: the codecs')"
    )
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.slice:
        codec_base.SLICE_BY_DEVICE["cuda"] = args.slice
    print(f"slice: {codec_base.slice_len(device)} elements on {device.type}")
    rows = []
    print("| numel | codec | bytes/elem | encode ms | decode ms | payload = CPU's | max diff |")
    print("|---:|---|---:|---:|---:|---|---:|")
    for numel in args.numel:
        for name in args.codecs:
            r = measure(name, device, numel, args.iters, args.warmup, args.check)
            rows.append(r)
            print(
                f"| {numel / 1e6:.1f}M | {name} | {r['bytes_per_element']:.4f} | "
                f"{r['encode_ms']:.2f} | {r['decode_ms']:.2f} | "
                f"{r.get('payload_equal_cpu', '-')} | {r.get('decoded_max_abs_diff_cpu', '-')} |",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()

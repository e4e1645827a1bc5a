"""Peak memory of optimizer steps in one process, beyond the parameters and gradients.

Used by ``memory.py --device``. On a GPU: ``torch.cuda.max_memory_allocated`` over building the
optimizer and three steps, minus what the parameters and gradients held before; on a CPU (the
smoke run), the bytes of the tensors reachable from the optimizer that are neither parameters
nor gradients (``memory.reachable_tensors``), as no allocator peak is kept there.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import torch
from _loopback import loop_back
from shape_sets import shapes

import decent_optim as dopt

LR = 1e-4
#: extra memory over fused AdamW's allowed, in parameter copies: one receive buffer (issue 24's
#: target), and for AccumAdamW its gradient accumulator besides
TARGETS = {"DecentralizedAdamW, full step": 1.0, "AccumAdamW(accum_iter=4), full step": 2.0}


def _looped(opt):
    loop_back(opt, lend="received")  # one receive-sized buffer per bucket, as the real gossip
    return opt


CASES = {
    "torch.optim.AdamW(fused=True)": lambda ps: torch.optim.AdamW(ps, lr=LR, fused=True),
    "DecentralizedAdamW, full step": lambda ps: _looped(dopt.DecentralizedAdamW(ps, lr=LR)),
    "AccumAdamW(accum_iter=4), full step": lambda ps: _looped(
        dopt.AccumAdamW(ps, lr=LR, accum_iter=4)
    ),
    "torch.optim.SGD(momentum=0.9, fused=True)": lambda ps: torch.optim.SGD(
        ps, lr=LR, momentum=0.9, fused=True
    ),
    "DSGD(momentum=0.9), full step": lambda ps: _looped(dopt.DSGD(ps, lr=LR, momentum=0.9)),
}


def measure(device: str, shape_name: str, name: str) -> dict:
    cuda = device.startswith("cuda")
    gc.collect()  # the last case's optimizer may sit in reference cycles
    if cuda:
        torch.cuda.empty_cache()
    gen = torch.Generator(device).manual_seed(0)
    params = [
        torch.randn(s, generator=gen, device=device).requires_grad_() for s in shapes(shape_name)
    ]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, device=device)
    numel = sum(p.numel() for p in params)
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    opt = CASES[name](params)
    for _ in range(3):
        opt.step()
    if cuda:
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
    else:
        from memory import reachable_tensors

        skip = {p.untyped_storage().data_ptr() for p in params}
        skip |= {p.grad.untyped_storage().data_ptr() for p in params}
        found = reachable_tensors(opt, skip_ids={id(p) for p in params})
        extra = sum(b for ptr, b in found.items() if ptr not in skip)
    del opt, params
    return {"shape": shape_name, "optimizer": name, "params": numel, "extra_bytes": extra,
            "param_copies": extra / (4 * numel), "measure": "peak" if cuda else "reachable"}  # fmt: skip


def write_peaks(device: str, shape_names: list[str], out: Path) -> list[dict]:
    rows = [measure(device, s, name) for s in shape_names for name in CASES]
    where = device
    if device.startswith("cuda"):
        where = f"{device} ({torch.cuda.get_device_name()}), torch.cuda.max_memory_allocated"
    else:
        where = f"{device}, tensors reachable from the optimizer (no allocator peak on CPUs)"
    lines = [
        f"optimizer memory beyond parameters and gradients over 3 steps, one process, {where}, "
        "float32",
        "",
        "| shape | params | optimizer | extra GB | parameter copies |",
        "|---|---:|---|---:|---:|",
    ]
    lines += [
        f"| {r['shape']} | {r['params'] / 1e6:.1f}M | {r['optimizer']} | "
        f"{r['extra_bytes'] / 1e9:.3f} | {r['param_copies']:.2f} |"
        for r in rows
    ]
    lines += ["", "| shape | target | measured | status |", "|---|---|---:|---|"]
    for s in shape_names:
        copies = {r["optimizer"]: r["param_copies"] for r in rows if r["shape"] == s}
        fused = copies["torch.optim.AdamW(fused=True)"]
        for name, limit in TARGETS.items():
            status = "met" if copies[name] <= fused + limit + 1e-3 else "**missed**"
            lines.append(
                f"| {s} | {name} <= fused AdamW + {limit:g} copies ({fused + limit:.2f}) "
                f"| {copies[name]:.2f} | {status} |"
            )
    table = "\n".join(lines)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    name = f"memory_{torch.device(device).type}"
    (out / f"{name}.json").write_text(json.dumps({"device": where, "rows": rows}, indent=2))
    (out / f"{name}.md").write_text(table + "\n")
    return rows

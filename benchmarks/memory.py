"""Optimizer + communication memory per parameter, per class, on 2 gloo ranks.

    torchrun --standalone --nproc-per-node 2 benchmarks/memory.py          # memory.{json,md}
    torchrun --standalone --nproc-per-node 4 benchmarks/memory.py --compressed
    torchrun --standalone --nproc-per-node 4 benchmarks/memory.py --sharded
    python benchmarks/memory.py --device cuda --shapes gpt-1.3b [--out DIR]

After a few steps on a model of many small and a few large tensors, every tensor reachable from
the optimizer (state, flat buffers, gossip receive buffers, scratch; for Decent-DP its wrapper's
optimizers, copies and blocks) is counted once per storage, in bytes and in parameter-sized
buffers; parameters and gradients are left out, as torch counts them apart (DDP's reducer
buckets live in C++: DDP is listed with its optimizer only). ``--compressed``: 4 ranks as 2 nodes
of 2 on ``alternating-exp-ring``, ``compression=None``, ``"bf16"``, ``"int8"``. ``--sharded``:
FSDP2 (``fully_shard`` per layer on ``mesh["shard"]``) with 1, 2 and 4 shards per replica, per
rank, against the whole model's parameter bytes. ``--device``: one process, the peak of three
optimizer steps beyond parameters and gradients (``torch.cuda.max_memory_allocated``; on a CPU,
the reachable tensors) for fused AdamW and the full steps of DecentralizedAdamW, AccumAdamW and
DSGD over the loopback gossip of ``_loopback.py`` (``memory_peak.py``). Target (issue 24):
DecentralizedAdamW <= fused AdamW + one parameter copy. Results: ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import decent_optim as dopt
from decent_optim.sharded import local

RESULTS = Path(__file__).resolve().parent / "results"


def model() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(64, 64) for _ in range(40)] + [nn.Linear(64, 512), nn.Linear(512, 512)]
    return nn.Sequential(*layers)


def reachable_tensors(root, skip_ids: set[int]) -> dict[int, int]:
    """{storage pointer: bytes} of every tensor reachable from ``root`` through attributes."""
    seen: set[int] = set()
    out: dict[int, int] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or id(obj) in skip_ids:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            st = local(obj).untyped_storage()  # a DTensor's memory is its local tensor's
            out[st.data_ptr()] = st.nbytes()
            continue
        if isinstance(obj, dict):
            stack += list(obj.keys()) + list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack += list(obj)
        elif isinstance(obj, (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)):
            continue
        elif callable(obj) and not hasattr(obj, "__dict__"):
            continue
        else:
            if hasattr(obj, "__dict__") and not isinstance(obj, type):
                stack += list(vars(obj).values())
            for cls in type(obj).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    if hasattr(obj, name):
                        stack.append(getattr(obj, name))
    return out


def measure(name: str, build) -> dict:
    net = model()
    params = list(net.parameters())
    numel = sum(p.numel() for p in params)
    holder, step = build(net)
    for _ in range(3):
        forward = holder if isinstance(holder, nn.Module) else net  # Decent-DP wraps the model
        forward(torch.randn(8, 64)).square().mean().backward()
        step()
    if hasattr(holder, "synchronize"):
        holder.synchronize()
    params = list(net.parameters())  # FSDP2's, when it sharded them: their local shards
    exclude = {local(p).untyped_storage().data_ptr() for p in params}
    exclude |= {local(p.grad).untyped_storage().data_ptr() for p in params if p.grad is not None}
    found = reachable_tensors(holder, skip_ids={id(net)})
    extra = _union(ptr_size for ptr_size in found.items() if ptr_size[0] not in exclude)
    return {"class": name, "params": numel, "bytes": extra, "bytes_per_param": extra / numel,
            "param_buffers": extra / (numel * 4)}  # fmt: skip


def _union(spans) -> int:
    """Bytes covered by ``(start, size)`` spans: per-tensor aliases of a flat buffer (storages of
    their own over its memory, decent_optim.flat.alias_of) must not count twice."""
    total, reach = 0, 0
    for start, size in sorted((a, b) for a, b in spans if b > 64):
        end = start + size
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def compressed_cases() -> list:
    def build(net, c):
        opt = dopt.DecentralizedAdamW(
            net.parameters(), lr=1e-3, topology="alternating-exp-ring", local_world_size=2,
            compression=c,
        )  # fmt: skip
        return _opt(opt)

    return [(f"DecentralizedAdamW (alternating-exp-ring, 2 nodes x 2, compression={c})",
             partial(build, c=c)) for c in (None, "bf16", "int8")]  # fmt: skip


def sharded_cases() -> list:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def build(net, shards):
        world = dist.get_world_size()
        mesh = init_device_mesh("cpu", (world // shards, shards), mesh_dim_names=("r", "s"))
        for layer in net:
            fully_shard(layer, mesh=mesh["s"])
        fully_shard(net, mesh=mesh["s"])
        return _opt(dopt.DecentralizedAdamW(net.parameters(), lr=1e-3, process_group=mesh["r"]))

    return [(f"DecentralizedAdamW on FSDP2, {s} shard(s) per replica", partial(build, shards=s))
            for s in (1, 2, 4)]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compressed", action="store_true")
    parser.add_argument("--sharded", action="store_true")
    parser.add_argument("--device", default=None, help="one process: peak memory on this device")
    parser.add_argument("--shapes", nargs="+", default=["gpt-125m"])
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if args.device is not None:
        from memory_peak import write_peaks

        write_peaks(args.device, args.shapes, Path(args.out))
        return
    dist.init_process_group("gloo")
    compressed = args.compressed
    kw = dict(lr=1e-3)
    cases = [
        ("torch.optim.AdamW (reference)", lambda n: _opt(torch.optim.AdamW(n.parameters(), **kw)))
    ]
    for topo in ("ring", "complete"):
        for cls in (dopt.DSGD, dopt.DecentralizedAdam, dopt.DecentralizedAdamW, dopt.AccumAdam,
                    dopt.AccumAdamW):  # fmt: skip
            extra = dict(momentum=0.9) if cls is dopt.DSGD else {}
            cases.append((f"{cls.__name__} ({topo})",
                          partial(lambda n, c, t, e: _opt(c(n.parameters(), topology=t, **kw, **e)),
                                  c=cls, t=topo, e=extra)))  # fmt: skip
    try:
        from decent_dp.ddp import DecentralizedDataParallel
        from decent_dp.optim import optim_fn_adamw

        def decentdp(n):
            w = DecentralizedDataParallel(n, optim_fn=optim_fn_adamw, topology="ring")
            return w, (lambda: None)

        cases.append(("Decent-DP 0.2.3 AdamW (ring)", decentdp))
    except ImportError:
        pass
    if compressed:
        cases = cases[:1] + compressed_cases()
    if args.sharded:
        cases = cases[:1] + sharded_cases()
    rows = [measure(name, build) for name, build in cases]
    if dist.get_rank() == 0:
        lines = [
            "| optimizer (topology) | bytes / param | param-sized buffers |",
            "|---|---:|---:|",
        ]
        lines += [
            f"| {r['class']} | {r['bytes_per_param']:.2f} | {r['param_buffers']:.2f} |"
            for r in rows
        ]
        table = (f"optimizer + communication memory beyond parameters and gradients, "
                 f"{dist.get_world_size()} ranks, "
                 f"float32, {rows[0]['params'] / 1e6:.2f}M parameters\n\n" + "\n".join(lines))  # fmt: skip
        print(table)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = "memory_compressed" if compressed else "memory"
        name = "memory_sharded" if args.sharded else name
        (out / f"{name}.json").write_text(json.dumps(rows, indent=2))
        (out / f"{name}.md").write_text(table + "\n")
    dist.destroy_process_group()


def _opt(opt):
    def step():
        opt.step()
        opt.zero_grad()

    return opt, step


if __name__ == "__main__":
    main()

"""Process-group queries and the few plain collectives outside the gossip rounds.

Start-up (which group, which device, do the ranks agree, broadcast the start values) and the
measurements of :mod:`decent_optim.plan` reach :mod:`torch.distributed` only through here.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "all_reduce_",
    "barrier",
    "broadcast_",
    "check_same_parameters",
    "comm_device",
    "gather_floats",
    "group_info",
    "identical",
    "init_from_environment",
    "resolve_group",
    "shutdown",
    "slowest",
]


def resolve_group(process_group: Any) -> tuple[Any, int]:
    """``(group, its size)``: the given group or the world; ``(None, 1)`` without distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise RuntimeError(
                "process_group was given but torch.distributed is not initialised; call "
                "dist.init_process_group(...) first"
            )
        _check_alone()
        return None, 1
    group = process_group if process_group is not None else dist.group.WORLD
    return group, dist.get_world_size(group)


def _check_alone() -> None:
    """Raise when torchrun started several workers but this one has no process group.

    Training alone would go on silently, each worker on its own copy, never mixed.
    """
    workers = os.environ.get("WORLD_SIZE", "1")
    if workers.strip().isdigit() and int(workers) > 1:
        raise RuntimeError(
            f"WORLD_SIZE={workers.strip()} in the environment (torchrun started {workers.strip()} "
            "workers), but torch.distributed has no process group, so this worker would train "
            "alone; call torch.distributed.init_process_group() (e.g. "
            '`dist.init_process_group("gloo")`, or "nccl" on GPUs) before building the optimizer'
        )


def comm_device(group: Any, params: list[Tensor]) -> torch.device:
    """The device the group's backend exchanges tensors on; raises if ``params`` live elsewhere."""
    backend = dist.get_backend(group)
    devices = {p.device.type for p in params}
    if backend == "nccl":
        if devices - {"cuda"}:
            raise ValueError(
                f"the NCCL backend exchanges CUDA tensors only, but parameters are on {sorted(devices)}; "
                "move the model to the GPU before building the optimizer, or use gloo"
            )
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo" and devices - {"cpu"}:
        raise ValueError(
            f"the gloo backend sends CPU tensors only, but parameters are on {sorted(devices)}; "
            "use the NCCL backend for GPU training"
        )
    return torch.device("cpu")


def check_same_parameters(params: list[Tensor], group: Any, device: torch.device) -> None:
    """All-gather a fingerprint of the parameter shapes and dtypes; raise on any difference."""
    desc = ";".join(f"{tuple(p.shape)}:{p.dtype}" for p in params)
    mine = torch.tensor(
        [len(params), sum(p.numel() for p in params), zlib.crc32(desc.encode())],
        dtype=torch.int64,
        device=device,
    )
    world = dist.get_world_size(group)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    rows = [tuple(int(v) for v in t.tolist()) for t in everyone]
    differ = [r for r in range(world) if rows[r] != rows[0]]
    if differ:
        detail = ", ".join(
            f"rank {r}: {rows[r][0]} tensors / {rows[r][1]} elements" for r in [0, *differ]
        )
        same_sizes = len({r[:2] for r in rows}) == 1
        raise ValueError(
            "the parameters differ across ranks (shapes or dtypes); every rank must build the same "
            f"model before the optimizer. {detail}"
            + (" (same sizes, different shapes or dtypes)" if same_sizes else "")
        )


def broadcast_(tensors: Sequence[Tensor], group: Any) -> None:
    """In place: every rank's tensors become group rank 0's."""
    src = dist.get_global_rank(group, 0)
    for t in tensors:
        dist.broadcast(t, src=src, group=group)


def identical(values: Sequence[float], group: Any, device: torch.device) -> bool:
    """Whether every rank of ``group`` passed bit-identical ``values`` (one small all-reduce)."""
    mine = torch.tensor([*values, *(-v for v in values)], dtype=torch.float64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
    n = len(values)
    return bool(torch.equal(mine[:n], -mine[n:]))  # the largest value equals the smallest


# -- for measurements (decent_optim.plan) ------------------------------------------------------


def init_from_environment() -> torch.device:
    """Join the job torchrun described in the environment (NCCL on GPUs, else gloo)."""
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    return torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")


def shutdown() -> None:
    dist.destroy_process_group()


def group_info() -> tuple[int, int, str]:
    """``(rank, world size, backend)`` of the world group."""
    return dist.get_rank(), dist.get_world_size(), str(dist.get_backend())


def barrier() -> None:
    dist.barrier()


def slowest(seconds: float, device: torch.device) -> float:
    """The largest value over the ranks (an operation ends when its slowest rank is done)."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def gather_floats(values: list[float], device: torch.device) -> list[float]:
    """Every rank's ``values``, concatenated in rank order (each rank passes as many)."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [float(v) for t in everyone for v in t.tolist()]


def all_reduce_(tensor: Tensor) -> None:
    """In place: the sum over the world group."""
    dist.all_reduce(tensor)

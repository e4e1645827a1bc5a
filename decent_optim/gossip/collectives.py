"""Process-group queries and the few plain collectives outside the gossip rounds.

Start-up (which group, which device, do the ranks agree, broadcast the start values) and the
measurements of :mod:`decent_optim.plan` reach :mod:`torch.distributed` only through here.
"""

from __future__ import annotations

import datetime
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from decent_optim.gossip.arrival import Arrival
from decent_optim.gossip.handle import GossipHandle

__all__ = [
    "all_reduce_",
    "barrier",
    "broadcast_",
    "channel",
    "check_devices",
    "comm_device",
    "gather_floats",
    "gather_ints",
    "gather_objects",
    "group_info",
    "identical",
    "init_from_environment",
    "resolve_group",
    "shutdown",
    "slowest",
    "wait_bounded",
]

#: why a start-up collective usually fails: the ranks did not all reach it, or reached it on
#: different process groups (collectives on two groups never match)
STARTUP_HINT = (
    "Every rank must build the optimizer at the same point of the program, with the same "
    "process_group= (None on every rank, or a group with the same ranks on every rank: a rank "
    "passing None waits on the world group while the others wait on their sub-group); a rank "
    "may also have died or be busy elsewhere. Pass timeout= to the optimizer to wait less"
)


def wait_bounded(
    works: Sequence[Any],
    group: Any,
    timeout: datetime.timedelta | None,
    what: str,
    hint: str | None = None,
    arrival: Arrival | None = None,
) -> None:
    """Wait for ``works`` (collectives on ``group``) at most ``timeout``; a timeout or transport
    error raises :class:`~decent_optim.gossip.GossipError` naming ``what`` and the group's ranks
    (with ``arrival``, made before ``works`` were launched: the ranks that never reached it)."""
    rank = dist.get_rank(group)
    others = [r for r in range(dist.get_world_size(group)) if r != rank]
    GossipHandle(
        [(w, None) for w in works],
        None,
        rank=rank,
        timeout=timeout,
        what=what,
        group_peers=others,
        hint=hint,
        late=None if arrival is None else arrival.missing,
    ).wait()


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
    if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        raise ValueError(
            f"process_group does not contain this process (global rank {dist.get_rank()}); build "
            "the optimizer only on the ranks of its group (dist.new_group returns a placeholder "
            "on the other ranks), or pass a group this rank belongs to"
        )
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


def group_ranks(group: Any) -> tuple[list[int], int]:
    """The global ranks of ``group``'s members, in group order, and this process's global rank."""
    return list(dist.get_process_group_ranks(group)), dist.get_rank()


def comm_device(group: Any) -> torch.device:
    """The device the group's backend exchanges tensors on."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_devices(group: Any, params: list[Tensor]) -> None:
    """Raise if the group's backend cannot exchange tensors on the devices of ``params``."""
    backend = dist.get_backend(group)
    devices = {p.device.type for p in params}
    if backend == "nccl" and devices - {"cuda"}:
        raise ValueError(
            f"the NCCL backend exchanges CUDA tensors only, but parameters are on {sorted(devices)}; "
            "move the model to the GPU before building the optimizer, or use gloo"
        )
    if backend == "gloo" and devices - {"cpu"}:
        raise ValueError(
            f"the gloo backend sends CPU tensors only, but parameters are on {sorted(devices)}; "
            "use the NCCL backend for GPU training"
        )


def gather_ints(
    values: list[int],
    group: Any,
    device: torch.device,
    timeout: datetime.timedelta | None = None,
    what: str = "a start-up check",
    hint: str | None = STARTUP_HINT,
    arrival: Arrival | None = None,
) -> list[list[int]]:
    """Every rank's ``values`` (as many on every rank), by group rank: one all-gather, waited
    for at most ``timeout`` (:func:`wait_bounded`; ``what`` names it in the error)."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(everyone, mine, group=group, async_op=True)
    wait_bounded([work], group, timeout, what, hint, arrival)
    return [[int(v) for v in t.tolist()] for t in everyone]


def gather_objects(
    obj: Any,
    group: Any,
    timeout: datetime.timedelta | None = None,
    what: str = "an exchange of messages",
    hint: str | None = None,
    arrival: Arrival | None = None,
) -> list[Any]:
    """Every rank's picklable ``obj``, by group rank (for messages: slower than gather_ints).

    Two all-gathers, of the pickled sizes and of the padded bytes, each waited for at most
    ``timeout`` (torch's ``all_gather_object`` cannot be bounded); the rest as :func:`gather_ints`.
    """
    device = comm_device(group)
    data = pickle.dumps(obj)
    sizes = gather_ints([len(data)], group, device, timeout, what, hint, arrival)
    longest = max(row[0] for row in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    everyone = [torch.empty_like(mine) for _ in sizes]
    work = dist.all_gather(everyone, mine, group=group, async_op=True)
    wait_bounded([work], group, timeout, what, hint)
    return [pickle.loads(bytes(t[: row[0]].tolist())) for t, row in zip(everyone, sizes)]


#: a process group of the whole world per optimizer slot >= 1 (see :func:`channel`)
_CHANNELS: dict[int, Any] = {}


def channel(group: Any, slot: int) -> Any:
    """The process group optimizer number ``slot`` of ``group`` exchanges over.

    Optimizer 0 uses ``group`` itself. Every further optimizer that lives at the same time gets
    a group of its own with the same ranks, so that its collectives (all-reduce rounds, global
    averages) and sends can never be matched with another optimizer's, whatever order the
    ranks step them in. Such a group can only be created when ``group`` is the whole world
    (``new_group`` is a collective of every process): on a smaller group the optimizers share
    it, their point-to-point messages are told apart by tag, and their collectives follow the
    order of the steps. Groups are kept per slot and reused by the next optimizer in that slot.
    """
    if slot == 0 or dist.get_world_size(group) != dist.get_world_size():
        return group
    made = _CHANNELS.get(slot)
    if made is not None:
        try:
            dist.get_process_group_ranks(made)
            return made
        except KeyError:  # destroyed since (with the world, or by its creator)
            pass
    made = _CHANNELS[slot] = dist.new_group(dist.get_process_group_ranks(group))
    return made


def broadcast_(
    tensors: Sequence[Tensor],
    group: Any,
    timeout: datetime.timedelta | None = None,
    what: str = "the start-up broadcast of rank 0's values",
) -> None:
    """In place: every rank's tensors become group rank 0's (waited for at most ``timeout``)."""
    src = dist.get_global_rank(group, 0)
    works = [dist.broadcast(t, src=src, group=group, async_op=True) for t in tensors]
    wait_bounded(works, group, timeout, what, STARTUP_HINT)


def identical(
    values: Tensor,
    group: Any,
    timeout: datetime.timedelta | None = None,
    what: str = "a check of identical values",
) -> Callable[[], bool]:
    """Whether every rank of ``group`` passed bit-identical ``values`` (a 1-D float64 tensor on
    the group's device): one small all-reduce, launched now; the returned function waits for it
    (at most ``timeout``, else :class:`~decent_optim.gossip.GossipError` naming ``what``)."""
    both = torch.cat([values, -values])
    work = dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group, async_op=True)
    n = values.numel()

    def answer() -> bool:
        wait_bounded([work], group, timeout, what)
        return bool(torch.equal(both[:n], -both[n:]) and both[:n].any())  # largest == smallest

    return answer


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

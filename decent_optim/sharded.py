r"""Sharded parameters (DTensors, e.g. FSDP2's ``fully_shard``): the gossip works on local shards.

Decentralized HSDP: each replica of the model is sharded with FSDP2 over the ranks of its node
(``fully_shard(block, mesh=mesh["shard"])`` on a 1-D mesh), and the optimizer gossips over the
other mesh dimension (``process_group=mesh["replicate"]``, a 1-D ``DeviceMesh`` or its
``ProcessGroup``). Rank (replica :math:`r`, shard :math:`s`) mixes its local shards with the
ranks :math:`(r', s)` of its neighbour replicas :math:`r'`. Every shard index runs the same
mixing matrix :math:`W` on its slice, and mixing and the local update are elementwise, so

.. math::
    \big[\textstyle\sum_{r'} W_{rr'} x_{r'}\big]_s = \textstyle\sum_{r'} W_{rr'} [x_{r'}]_s,

i.e. the sharded run equals gossiping the unsharded replicas, up to floating-point summation
order (0.0 difference in float64 in ``tests/test_sharded.py``, 7e-18 for DSGD). FSDP2 averages each gradient
over the replica's own shard group, which is the replica's gradient.

**Storage: a copy, not an alias.** The buckets hold this rank's local shards in memory of their
own; after every change to the buckets (the update, the start-up broadcast, ``averaged()``, a
loaded checkpoint) :meth:`Mirror.publish` copies them into FSDP2's sharded storage (the DTensor's
``_local_tensor``, a view of FSDP2's padded ``_sharded_param_data``), which FSDP2 all-gathers
before the next forward. Writes the other way (``model.load_state_dict``, ``p.copy_``) are seen by
the local tensors' version counters and copied into the buckets before the next step
(:meth:`Mirror.moved`, :meth:`Mirror.readopt`). Rejected: aliasing FSDP2's padded storage into
the buckets, which saves that copy. The optimizer receives parameters, not the FSDP2 modules
that own the storage objects (``FSDPParam``), and FSDP2 re-allocates and re-points a padded
shard on its own (``reset_sharded_param`` at lazy init, after ``.to()`` and after
``load_state_dict``), which would silently cut such an alias. The alias would save exactly the
copy and its memory; measured with ``benchmarks/sharded_storage.py`` (retired; ``git show
f11e7f3:benchmarks/sharded_storage.py``; 16.8M parameters over 2 gloo CPU shards, 1 thread):
32 MiB per rank next to 64 MiB of AdamW state, and 2.9 ms per step,
28% of the optimizer step (a copy moves 8 bytes per parameter, AdamW 28) but 1% of an iteration
of 284 ms. Robustness wins over that 1%.

FSDP2's padding (the last rows of an uneven shard) is never written: only the local tensor's
own elements are copied, so it stays zero, and a rank whose shard has no rows holds an empty
slice. ``opt.state[p]`` holds DTensors over views of the flat state buffers (same mesh and
placements as ``p``), so ``torch.distributed.checkpoint`` can reshard them.

This module never imports :mod:`torch.distributed`: a DTensor is recognised by what it has
(``_local_tensor``, ``device_mesh``, ``placements``) and new ones are made by its own class.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "Mirror",
    "check_params",
    "describe",
    "full",
    "gossip_group",
    "is_sharded",
    "local",
    "replica_ranks",
    "replica_sum",
    "replicas_per_node",
    "shown",
]

_MESH_FIX = (
    'shard each replica on a 1-D mesh, fully_shard(block, mesh=mesh["shard"]), and gossip over '
    'the other dimension, DecentralizedAdamW(..., process_group=mesh["replicate"])'
)


def is_sharded(t: Any) -> bool:
    """Whether ``t`` is a DTensor (FSDP2 parameter, tensor-parallel shard, their gradients)."""
    return hasattr(t, "_local_tensor") and hasattr(t, "device_mesh") and hasattr(t, "placements")


def local(t: Tensor) -> Tensor:
    """This rank's part of ``t``: the local shard of a DTensor, ``t`` itself otherwise."""
    return t._local_tensor if is_sharded(t) else t  # type: ignore[attr-defined, no-any-return]


def gossip_group(process_group: Any) -> Any:
    """``process_group=`` as a process group: a 1-D ``DeviceMesh`` gives its group."""
    if process_group is None or not hasattr(process_group, "get_group"):
        return process_group
    if process_group.ndim != 1:
        raise ValueError(
            f"process_group= is a {process_group.ndim}-D DeviceMesh; pass the 1-D mesh of the "
            f'replicas, e.g. process_group=mesh["replicate"] ({_MESH_FIX})'
        )
    return process_group.get_group()


def _mesh_ranks(p: Any) -> list[int]:
    return [int(r) for r in p.device_mesh.mesh.flatten().tolist()]


def check_params(params: Sequence[Tensor], gossip_ranks: list[int] | None, me: int) -> None:
    """Raise for sharded parameters the gossip cannot handle (module docstring).

    Args:
        params: every parameter of the optimizer.
        gossip_ranks: global ranks of the gossip group (None: a world of one).
        me: this process's global rank.
    """
    for p in params:
        # FSDP1 marks its flat parameters, and with use_orig_params=True the views of them
        if getattr(p, "_is_flat_param", False) or getattr(p, "_fsdp_flattened", False):
            raise TypeError(
                "the model is wrapped in FSDP1 (FullyShardedDataParallel), which is not "
                "supported: every rank holds a different flat shard, and gossip would average "
                "unrelated shards together. Use FSDP2 instead, "
                "torch.distributed.fsdp.fully_shard(block, mesh=mesh['shard']) on each block "
                "and the root, and gossip over mesh['replicate'] (docs: large_models)"
            )
    dtensors = [p for p in params if is_sharded(p)]
    if not dtensors:
        return
    plain = [p for p in params if not is_sharded(p) and p.requires_grad]
    if plain:
        raise TypeError(
            f"{len(dtensors)} parameter(s) are sharded DTensors but {len(plain)} trainable one(s) "
            f"(the first of shape {tuple(plain[0].shape)}) are plain tensors: each shard rank "
            "would update its plain copy with its own gradient, and the copies of one replica "
            "would drift apart. Apply fully_shard to the root module as well (it shards the "
            "remaining parameters), or freeze those parameters"
        )
    for p in dtensors:
        mesh = p.device_mesh  # type: ignore[attr-defined]
        if mesh.ndim != 1:
            raise ValueError(
                f"a parameter of shape {tuple(p.shape)} is sharded on a {mesh.ndim}-D mesh "
                f"{tuple(mesh.shape)} (FSDP2's HSDP); its replicate all-reduce cannot be turned "
                f"off, so gossip cannot replace it. Instead, {_MESH_FIX}"
            )
        if not all(pl.is_shard() for pl in p.placements):  # type: ignore[attr-defined]
            raise ValueError(
                f"a parameter of shape {tuple(p.shape)} has placements {p.placements} "  # type: ignore[attr-defined]
                "on its mesh; only Shard placements are supported (a Replicate or Partial "
                "DTensor would be updated separately on each rank of its mesh)"
            )
        shared = set(_mesh_ranks(p)) & set(gossip_ranks or [me])
        if gossip_ranks is not None and shared != {me}:
            raise ValueError(
                f"the gossip group (global ranks {gossip_ranks}) overlaps the mesh a parameter "
                f"is sharded on (global ranks {_mesh_ranks(p)}): it would mix different shards. "
                f"Gossip over the ranks that hold the same shard in other replicas: {_MESH_FIX}"
            )


def replica_ranks(params: Sequence[Tensor]) -> list[int]:
    """Global ranks that hold this rank's replica: the meshes its sharded parameters live on."""
    return sorted({r for p in params if is_sharded(p) for r in _mesh_ranks(p)})


def describe(p: Tensor) -> str:
    """What the ranks of a gossip group must share about ``p`` beyond its global shape: the shard
    index, the local shape and the layout of the mesh it is sharded on."""
    if not is_sharded(p):
        return ""
    mesh = p.device_mesh  # type: ignore[attr-defined]
    where = mesh.get_coordinate()
    return (
        f", sharded {list(p.placements)} over a mesh of {tuple(mesh.shape)}, "  # type: ignore[attr-defined]
        f"shard index {where}, local shape {tuple(local(p).shape)}"
    )


def replicas_per_node(gossip_ranks: list[int], me: int) -> int:
    """The replicas on this rank's node: members of the gossip group on the same node, where a
    node holds ``LOCAL_WORLD_SIZE`` consecutive global ranks (torchrun's layout; 1 unset)."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, sum(r // per_node == me // per_node for r in gossip_ranks))


def shown(view: Tensor, p: Tensor) -> Tensor:
    """``view`` (a local state tensor) as ``opt.state`` shows it: a DTensor laid out like ``p``."""
    if not is_sharded(p):
        return view
    # as FSDP2 makes its parameters: a DTensor without autograd history
    make: Any = type(p)
    return make(view, p._spec, requires_grad=False)  # type: ignore[attr-defined, no-any-return]


def replica_sum(params: Sequence[Tensor]) -> Callable[[float], float]:
    """A function summing a number over the shard mesh of ``params`` (the identity when none is
    sharded): a replica's squared distance is the sum of its shards'."""
    first = next((p for p in params if is_sharded(p)), None)
    if first is None:
        return lambda value: value
    mesh, shard = first.device_mesh, type(first.placements[0])(0)  # type: ignore[attr-defined]

    def total(value: float) -> float:
        mine = torch.tensor([value], dtype=torch.float64, device=local(first).device)
        every = type(first).from_local(mine, mesh, [shard], run_check=False)  # type: ignore[attr-defined]
        return float(every.full_tensor().sum())

    return total


def full(t: Tensor) -> Tensor:
    """The whole of ``t``: a DTensor gathered from its mesh (a collective), ``t`` otherwise."""
    return t.full_tensor() if is_sharded(t) else t  # type: ignore[attr-defined, no-any-return]


class Mirror:
    """Keeps the local shards of sharded parameters (FSDP2's storage) equal to a bucket's aliases.

    Args:
        params: the bucket's parameters (DTensors).
        aliases: their stretches of the bucket, laid out like their local shards.
    """

    def __init__(self, params: Sequence[Tensor], aliases: Sequence[Tensor]) -> None:
        self.params, self.aliases = list(params), list(aliases)
        self._seen: list[tuple[int, int, int, int]] = []
        self.publish()

    def _marks(self) -> list[tuple[int, int, int, int]]:
        # a write through the DTensor (load_state_dict, p.copy_) bumps the version of the
        # DTensor only, not of its local tensor (written below autograd); a direct write to
        # the local tensor, the other way round; FSDP2 may also swap the local tensor
        return [
            (id(local(p)), local(p).data_ptr(), local(p)._version, p._version) for p in self.params
        ]

    @torch.no_grad()
    def publish(self) -> None:
        """Copy the bucket's values into the local shards (what FSDP2 all-gathers)."""
        torch._foreach_copy_([local(p) for p in self.params], self.aliases)
        self._seen = self._marks()

    def moved(self) -> bool:
        """Whether a local shard was written or replaced since the last publish."""
        return self._marks() != self._seen

    @torch.no_grad()
    def readopt(self, owner: str) -> None:
        """Copy the local shards written since the last publish into the bucket."""
        now = self._marks()
        changed = [k for k, (a, b) in enumerate(zip(now, self._seen)) if a != b]
        for k in changed:
            new, alias = local(self.params[k]), self.aliases[k]
            if new.shape != alias.shape or new.dtype != alias.dtype or new.device != alias.device:
                raise RuntimeError(
                    f"the local shard of a sharded parameter of shape {tuple(self.params[k].shape)} "
                    f"was {tuple(alias.shape)} {alias.dtype} on {alias.device} when {owner} was "
                    f"built and is now {tuple(new.shape)} {new.dtype} on {new.device}; build the "
                    "optimizer after moving, casting or resharding the model"
                )
        for k in changed:
            self.aliases[k].copy_(local(self.params[k]))
        self._seen = self._marks()

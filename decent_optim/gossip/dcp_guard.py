"""Refuses a ``torch.distributed.checkpoint`` save that spans several replicas of a sharded model.

The replicas of a decentralized run differ, and DCP writes one copy of the chunks that look
alike on several ranks (same name, same offset), so ``dcp.save(get_state_dict(model, opt))``
over the default group would write a mix of the replicas, chunk by chunk, without a word. A
sharded optimizer's ``state_dict()`` therefore carries a :class:`ReplicaGuard` in
``param_groups[0]["decent_optim"]["replica"]``. DCP lets a value of a state dict plan its own
writes (``__create_write_items__``, called on every rank of the save while it plans, before
anything is written); the guard looks at the ranks of the save and raises when they reach beyond
its own replica. DCP gathers that error and raises it on every rank of the save.

How the guard sees the ranks: DCP passes them to no hook, so the guard reads the save's process
group from DCP's own frame (``_save_state_dict``, its ``distW``). Should a future torch rename
it, the guard warns instead of checking -- it never refuses a save it cannot judge.

Outside DCP the guard is a plain number, the replica's index: ``copy.deepcopy`` keeps it, and
pickling (``torch.save``, DCP's write of it) stores it as a 0-d tensor, so no checkpoint ever
names this class (``torch.load(weights_only=True)`` reads them).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ReplicaGuard", "save_replica", "save_ranks"]

_DCP = "torch.distributed.checkpoint"

_WAYS_OUT = (
    "Save each replica on its own, over the ranks of its replica: "
    "dcp.save(state, checkpoint_id=f'ckpt/replica{replica}', "
    "process_group=mesh['shard'].get_group()) with replica = mesh['replicate'].get_local_rank(); "
    "or save the consensus model only, where every replica holds it: with opt.averaged(model): "
    "dcp.save({'model': get_model_state_dict(model)}, checkpoint_id=...) (the optimizer states "
    "of the replicas are not averaged). With Lightning, use "
    "decent_optim.integrations.lightning.DecentralizedModelParallelStrategy instead of "
    "ModelParallelStrategy: it saves one checkpoint per replica. Docs: large_models, Checkpoints"
)


def save_ranks() -> list[int] | None:
    """Global ranks of the DCP save that is planning on this thread.

    Returns None when none is found (not called from DCP's save, or DCP changed); an empty list
    for a save that runs without ``torch.distributed`` (``no_dist=True``).
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_save_state_dict" and str(
            frame.f_globals.get("__name__", "")
        ).startswith(_DCP):
            wrapper = frame.f_locals.get("distW")
            if wrapper is None or not hasattr(wrapper, "use_dist"):
                return None
            if not wrapper.use_dist:
                return []
            group = wrapper.group if wrapper.group is not None else dist.group.WORLD
            return sorted(dist.get_process_group_ranks(group))
        frame = frame.f_back
    return None


def save_replica(state: dict[str, Any], checkpoint_id: Any, shard_group: Any) -> None:
    """``dcp.save`` of one replica's ``state`` over the ranks of that replica (``shard_group``)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=checkpoint_id, process_group=shard_group)


class ReplicaGuard(int):
    """The index of this rank's replica, which refuses to be saved with another replica's ranks.

    Args:
        replica: the replica's index (the rank in the gossip group).
        replicas: the number of replicas (the gossip group's size).
        ranks: global ranks of the replica (the meshes its parameters are sharded on).
    """

    replicas: int
    ranks: tuple[int, ...]

    def __new__(cls, replica: int, replicas: int, ranks: Sequence[int]) -> ReplicaGuard:
        guard = super().__new__(cls, replica)
        guard.replicas, guard.ranks = replicas, tuple(sorted(ranks))
        return guard

    def __repr__(self) -> str:
        return f"ReplicaGuard(replica {int(self)} of {self.replicas}, ranks {list(self.ranks)})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        # stored as a plain tensor: checkpoints never need this class to be read
        return torch.tensor(int(self)).__reduce_ex__(protocol)

    def __copy__(self) -> ReplicaGuard:
        return self

    def __deepcopy__(self, memo: Any) -> ReplicaGuard:
        return self

    def check(self, ranks: list[int] | None) -> None:
        """Raise if a save over the global ``ranks`` (None: unknown) reaches beyond the replica."""
        if ranks is None:
            warnings.warn(
                "decent_optim could not see which ranks this torch.distributed.checkpoint save "
                "runs on (torch's DCP changed), so it cannot check that they belong to one "
                "replica; a save over several replicas writes a mix of them. " + _WAYS_OUT,
                stacklevel=3,
            )
            return
        outside = sorted(set(ranks) - set(self.ranks))
        if not outside:
            return
        raise ValueError(
            f"this torch.distributed.checkpoint save runs on global ranks {ranks}, which hold "
            f"more than one replica of the model: rank {dist.get_rank()} is in replica "
            f"{int(self)} of {self.replicas} (ranks {list(self.ranks)}), ranks {outside} are not. "
            "The replicas differ, and DCP writes one copy of what looks alike on several ranks, "
            "so the checkpoint would mix the replicas chunk by chunk; nothing was written. "
            + _WAYS_OUT
        )

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        """DCP's planning hook: check the save's ranks, then save the index as DCP saves any
        object (one item, the same on every rank of the replica, so written once)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

        self.check(save_ranks())
        return [WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)]

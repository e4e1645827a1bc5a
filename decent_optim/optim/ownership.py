"""Whose state a checkpoint holds: refusing the file of another world size, topology or replica.

``state_dict()`` records who saved it (:mod:`decent_optim.optim.checkpoint`): in its own entry
the ``world_size``, the ``rank`` and the ``topology``; a sharded optimizer also puts the entries
every rank of a replica shares into ``param_groups[0]["decent_optim"]``, with the replica's index
as ``"replica"``, because that is all ``torch.distributed.checkpoint``'s state-dict tools keep.

The common way to lose a run's state without a word is to load one rank's state on every rank:
a script that saves on rank 0 only (``if master_process: torch.save(...)``), a framework's
checkpoint (which holds rank 0's), or a full state dict gathered on rank 0 and loaded everywhere
(the FSDP2 example of pytorch/examples). Each rank's model and optimizer state are its own here,
so every replica would restart from replica 0's and the others' training would be gone. The
file says which replica saved it, so loading it elsewhere raises, naming the fix.

Loading another replica's state is sometimes meant (start every replica from one copy): then
``load_state_dict(state_dict, another_replica=True)``, or, where a library calls
``load_state_dict`` for the user (``set_state_dict``), removing the recorded index first.

No run identity is recorded: torchrun's ``TORCHELASTIC_RUN_ID`` is new at every
``--standalone`` launch, so every resume would differ from the run that saved.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from decent_optim.optim.startup import topology_key

__all__ = ["KEY", "REPLICA", "check_owner", "saved_replica"]

#: the entry's name, in the state dict and in its ``param_groups[0]`` (sharded)
KEY = "decent_optim"

#: the replica's index in ``param_groups[0]["decent_optim"]`` of a sharded optimizer
REPLICA = "replica"

_ON_PURPOSE = (
    "To start this rank from another rank's state on purpose, call "
    "load_state_dict(state_dict, another_replica=True)"
)

_PER_RANK = (
    "every rank saves and loads a file of its own (torch.save on every rank to "
    "f'ckpt-rank{rank}.pt', or decent_optim.checkpoint.save(dir, model, opt, step=step) and "
    "load(dir, model, opt), which do that for you; a script that saves on rank 0 only (if "
    "rank == 0: torch.save(...)) and loads that file on every rank starts every rank from rank "
    "0's state. Accelerate's, the HF Trainer's and Lightning's own checkpoints hold rank 0's "
    "state only: use DecentralizedAccelerator, DecentralizedTrainer or, with Lightning, "
    "decent_optim.integrations.lightning.DecentralizedStrategy, which keep a file per rank)"
)

_PER_REPLICA = (
    "A full state dict gathered on one rank and loaded on every rank (get_optimizer_state_dict"
    "(..., options=StateDictOptions(full_state_dict=True)) or DTensor.full_tensor() saved on rank "
    "0, as in the FSDP2 example of pytorch/examples) holds one replica's state, and every "
    "replica would resume from it, losing its own. Save and load each replica's own state: "
    "torch.save({'model': model.state_dict(), 'opt': opt.state_dict()}, f'ckpt-rank{rank}.pt') "
    "on every rank (sharded, not full), or dcp.save and dcp.load per replica "
    "(checkpoint_id=f'ckpt/replica{replica}', process_group=mesh['shard'].get_group()); with "
    "Lightning, decent_optim.integrations.lightning.DecentralizedModelParallelStrategy with "
    "save_distributed_checkpoint=True (the default). Docs: large_models, Checkpoints. To start "
    "this replica from another replica's state on purpose, call load_state_dict(state_dict, "
    f"another_replica=True), or, where a library loads it for you (set_state_dict), delete "
    f"{REPLICA!r} from the state dict's param_groups[0][{KEY!r}] first"
)


def saved_replica(value: Any) -> int | None:
    """The replica index a state dict recorded: an ``int`` (the guard of
    :mod:`decent_optim.gossip.dcp_guard` is one), or the 0-d tensor that pickling and DCP make
    of it; None for anything else, which is then not checked."""
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_floating_point():
        return int(value.item())
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    return None


def check_owner(
    world_size: int, rank: int, topology: Any, extra: Any, *, another_replica: bool = False
) -> None:
    """Raise if ``extra`` (the checkpoint's entry) was saved by another world size, replica or
    topology than this optimizer's (``world_size``, ``rank``, ``topology``)."""
    if not isinstance(extra, dict):
        return
    fix = f"(or, to do so on purpose, delete that key from state_dict[{KEY!r}])"
    saved = extra.get("world_size")
    if saved is not None and saved != world_size:
        raise ValueError(
            f"the checkpoint was saved by a run of {saved} ranks, this one has "
            f"{world_size}: resume with the world size it was saved with, or save "
            "with decent_optim.checkpoint.save(dir, model, opt, step=step) and resume with "
            f"decent_optim.checkpoint.load(dir, model, opt), which resumes at another world size {fix}"
        )
    saved = extra.get("rank")
    if saved is not None and saved != rank and not another_replica:
        raise ValueError(
            f"rank {rank} loaded the checkpoint saved by rank {saved}: {_PER_RANK}. {_ON_PURPOSE}"
        )
    replica = saved_replica(extra.get(REPLICA)) if saved is None else None
    if replica is not None and replica != rank and not another_replica:
        raise ValueError(
            f"replica {rank} of {world_size} loaded the optimizer state saved by replica "
            f"{replica}. {_PER_REPLICA}"
        )
    saved, mine = extra.get("topology"), topology_key(topology)
    if saved is not None and saved != mine:
        raise ValueError(
            f"the checkpoint was saved with topology {saved}, this optimizer has {mine}: build it "
            f"with the topology of the saved run {fix}"
        )

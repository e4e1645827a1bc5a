"""Refuse, when the optimizer is built, a Lightning strategy that would run it wrong.

Two of Lightning's stock strategies run a decentralized optimizer without an error, and wrong:

* ``DDPStrategy`` (``strategy="ddp"`` and its spawn/fork variants) wraps the model in
  ``DistributedDataParallel``, whose gradient all-reduce keeps every rank's copy identical, so
  the gossip averages nothing; and its checkpoints hold rank 0's state only, which a resume
  would put on every rank.
* ``ModelParallelStrategy`` with two replicas or more trains, then dies at its first checkpoint:
  its distributed checkpoint is one ``torch.distributed.checkpoint`` save over all ranks, which
  would mix the replicas (they differ), and which :mod:`decent_optim.gossip.dcp_guard` refuses
  -- after the training it was meant to keep.

Both have a drop-in replacement in :mod:`decent_optim.integrations.lightning`, so the mistake
is raised at once, naming it. Lightning calls ``configure_optimizers`` from its strategy's
``setup_optimizers``, so the strategy is the ``self`` of a caller's frame: the frames are walked
when an optimizer with peers is built and ``lightning.pytorch`` is already imported (nothing
here imports a framework). A strategy not found there -- an optimizer built outside
``configure_optimizers``, a Lightning that calls it otherwise -- is not judged; the errors at
the first checkpoint and at resume name the fix as well.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

__all__ = ["check_strategy", "lightning_strategy"]

#: how far up the callers to look (Lightning's setup_optimizers is ~10 frames up)
_MAX_FRAMES = 64

_STRATEGIES = "lightning.pytorch.strategies"
_OURS = "decent_optim.integrations.lightning"


def lightning_strategy() -> Any | None:
    """The Lightning strategy among the callers' ``self``, or None (Lightning not imported, or
    not calling)."""
    base = getattr(sys.modules.get(_STRATEGIES), "Strategy", None)
    if base is None:
        return None
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        if frame.f_code.co_varnames[:1] == ("self",):
            owner = frame.f_locals.get("self")
            if isinstance(owner, base):
                return owner
        frame = frame.f_back
    return None


def check_strategy(name: str, world_size: int) -> None:
    """Raise if optimizer ``name``, with ``world_size`` ranks gossiping, is being built under a
    Lightning strategy that would run it wrong (module docstring)."""
    if world_size < 2:  # nothing to average, nothing per rank to lose
        return
    strategy = lightning_strategy()
    if strategy is None:
        return
    ours = sys.modules.get(_OURS)
    if ours is not None and isinstance(
        strategy, (ours.DecentralizedStrategy, ours.DecentralizedModelParallelStrategy)
    ):
        return
    stock = sys.modules[_STRATEGIES]
    kind = type(strategy).__name__
    if isinstance(strategy, getattr(stock, "ModelParallelStrategy", ())):
        raise TypeError(
            f"{name} is being built under Lightning's {kind} with {world_size} replicas, which "
            "would train and then fail at the first checkpoint: its distributed checkpoint is "
            "one save over all ranks, which would mix the replicas (they differ). Use "
            "decent_optim.integrations.lightning.DecentralizedModelParallelStrategy, with the "
            "same arguments (data_parallel_size=..., tensor_parallel_size=...): it saves one "
            "checkpoint per replica and resumes each from its own. Docs: with_lightning, "
            "large_models"
        )
    if isinstance(strategy, getattr(stock, "DDPStrategy", ())):
        raise TypeError(
            f"{name} is being built under Lightning's {kind}, which wraps the model in "
            "DistributedDataParallel: its gradient all-reduce would keep every rank's copy "
            "identical (the gossip would average nothing), and its checkpoints hold rank 0's "
            "state only. Use decent_optim.integrations.lightning.DecentralizedStrategy() where "
            "the script passed strategy='ddp' (it takes DDPStrategy's arguments): it keeps the "
            "model unwrapped and saves every rank's state. For a model sharded with FSDP2, "
            "DecentralizedModelParallelStrategy. Docs: with_lightning"
        )

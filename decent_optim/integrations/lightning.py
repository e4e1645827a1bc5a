"""Lightning with a decentralized optimizer: :class:`DecentralizedStrategy`.

``strategy="ddp"`` with a decent_optim optimizer runs, but DDP all-reduces the gradients on top
of the gossip (so the copies stay identical and the gossip averages nothing), and a checkpoint
holds rank 0's model and optimizer state only, so a resume puts rank 0's values on every rank.
This strategy launches exactly like ``"ddp"`` (same launchers, same process group, same
distributed samplers) and changes only that:

* the LightningModule is not wrapped in ``DistributedDataParallel``;
* every checkpoint ``X.ckpt`` gets one ``X.ckpt.rank{r}-of-{n}.pt`` per rank with that rank's
  model and optimizer states, which ``fit(ckpt_path=X.ckpt)`` restores on every rank (at
  another world size, each rank starts from the mean of the saved ones:
  :func:`~decent_optim.integrations.common.read_own_or_resized`); ``X.ckpt``
  itself holds the consensus model (the mean over the ranks), so
  ``Module.load_from_checkpoint(X.ckpt)`` gives the model to deploy;
* validation, test and prediction during or after ``fit`` run on the consensus model
  (``averaged()``), on every rank together.

``configure_optimizers`` must return decent_optim optimizers (schedulers as usual).

For models sharded with FSDP2 (``ModelParallelStrategy``: gossip over
``device_mesh["data_parallel"]``, shard over ``device_mesh["tensor_parallel"]``),
:class:`DecentralizedModelParallelStrategy` keeps Lightning's distributed checkpoints, one per
replica: the replicas differ, and a DCP save over all ranks -- ``ModelParallelStrategy``'s --
is refused (:mod:`decent_optim.gossip.dcp_guard`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from decent_optim.gossip.dcp_guard import save_replica
from decent_optim.integrations.common import (
    consensus,
    decentralized,
    rank_path,
    read_own_or_resized,
    save_rank_file,
)
from decent_optim.optim.checkpoint import KEY
from decent_optim.optim.engine import DecentralizedOptimizer

__all__ = ["DecentralizedModelParallelStrategy", "DecentralizedStrategy"]

#: what a rank's own file holds: these entries of Lightning's checkpoint, with the rank's values
_OWN = ("state_dict", "optimizer_states")


class DecentralizedStrategy(DDPStrategy):
    """``DDPStrategy`` without the DDP wrapper, with per-rank checkpoints and consensus evaluation.

    Takes ``DDPStrategy``'s arguments (``process_group_backend``, ``timeout``,
    ``start_method``, ...); those that configure the wrapper (``ddp_comm_hook``,
    ``find_unused_parameters``, ...) have nothing to act on. Use it as
    ``Trainer(strategy=DecentralizedStrategy(), devices=N)``.
    """

    strategy_name = "decentralized"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._evaluating = contextlib.ExitStack()
        self._failed = False

    def configure_ddp(self) -> None:
        """Keep the LightningModule itself: the optimizer averages the parameters."""

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        if self.world_size > 1 and not self._decentralized():
            names = ", ".join(type(o).__name__ for o in self.optimizers) or "none"
            raise TypeError(
                "DecentralizedStrategy averages no gradients, so configure_optimizers must return "
                f"a decent_optim optimizer (e.g. decent_optim.DecentralizedAdamW), got {names}"
            )

    def _decentralized(self) -> list[DecentralizedOptimizer]:
        return decentralized(self.optimizers)

    def _own_file(self, filepath: str | os.PathLike[str]) -> Path:
        return rank_path(f"{os.fspath(filepath)}.", self.global_rank, self.world_size)

    # -- evaluation on the consensus model --------------------------------------------------------
    def _enter_consensus(self) -> None:
        self._evaluating.close()
        self._evaluating.enter_context(consensus(self._decentralized(), self.lightning_module))

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._enter_consensus()

    def on_test_start(self) -> None:
        super().on_test_start()
        self._enter_consensus()

    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._enter_consensus()

    def on_validation_end(self) -> None:
        self._evaluating.close()  # each rank's own values back, bit for bit
        super().on_validation_end()

    def on_test_end(self) -> None:
        self._evaluating.close()
        super().on_test_end()

    def on_predict_end(self) -> None:
        self._evaluating.close()
        super().on_predict_end()

    def on_exception(self, exception: BaseException) -> None:
        self._evaluating.close()
        self._failed = True  # a peer may be gone: teardown must not wait for it
        super().on_exception(exception)

    def teardown(self) -> None:
        """Finish the round in flight before Lightning lets go of the process group.

        The last step launched a round; torn down under the peers' transfers (Lightning
        destroys the group at exit) it can hang the exit. The parameters end fully mixed.
        """
        if not self._failed:
            for opt in self._decentralized():
                opt.synchronize()
        super().teardown()

    # -- per-rank checkpoints ---------------------------------------------------------------------
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Every rank writes its own file; rank 0 writes ``filepath`` with the consensus model."""
        opts = self._decentralized()
        if not opts:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        own = {key: checkpoint[key] for key in _OWN if key in checkpoint}
        save_rank_file(self._own_file(filepath), own)
        with consensus(opts, self.lightning_module):  # a collective: every rank saves together
            # copies: an asynchronous CheckpointIO may write after the block restored the values
            mean = {k: v.detach().clone() for k, v in self.lightning_module_state_dict().items()}
        super().save_checkpoint({**checkpoint, "state_dict": mean}, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        """Lightning's checkpoint, with this rank's own model and optimizer states in it."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        states = checkpoint.get("optimizer_states", [])
        if any(KEY in s for s in states if isinstance(s, dict)):
            prefix = f"{os.fspath(checkpoint_path)}."  # as in _own_file
            try:  # this rank's file, or the mean of another world size's (resize)
                own, _ = read_own_or_resized(prefix, self.global_rank, self.world_size)
            except FileNotFoundError:
                if self.world_size > 1:
                    raise
                own = {}  # one rank: the checkpoint's own states are this rank's
            checkpoint.update(own)
        return checkpoint

    def remove_checkpoint(self, filepath: Any) -> None:
        opts = self._decentralized()
        if opts:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._own_file(filepath))
        super().remove_checkpoint(filepath)


class DecentralizedModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose distributed checkpoints hold one DCP checkpoint per replica.

    Takes ``ModelParallelStrategy``'s arguments: ``data_parallel_size`` counts the replicas
    (gossip over ``self.device_mesh["data_parallel"]`` in ``configure_optimizers``),
    ``tensor_parallel_size`` the shards of each (``fully_shard(block,
    mesh=self.device_mesh["tensor_parallel"])`` in ``configure_model``). A checkpoint ``X``
    (with ``save_distributed_checkpoint=True``, the default) is a folder of ``replica{r}``
    folders, each written by the ranks of replica ``r`` and read back by them, with Lightning's
    other state in each; with ``save_distributed_checkpoint=False`` it is
    ``ModelParallelStrategy``'s file (rank 0's replica, whole).
    """

    strategy_name = "decentralized_model_parallel"

    def _replica_folder(self, path: Path) -> Path:
        return path / f"replica{self.device_mesh['data_parallel'].get_local_rank()}"

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if not self._save_distributed_checkpoint or storage_options is not None:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        path = Path(self.broadcast(filepath))  # one path on every rank, as Lightning's
        folder = self._replica_folder(path)
        folder.mkdir(parents=True, exist_ok=True)
        states = {"state_dict": checkpoint.pop("state_dict")}
        for index, state in enumerate(checkpoint.pop("optimizer_states", [])):
            states[f"optimizer_{index}"] = state
        shards = self.device_mesh["tensor_parallel"]
        save_replica(states, folder, shards.get_group())
        if shards.get_local_rank() == 0:  # Lightning's other state, where its loader looks
            from lightning.fabric.utilities.load import _METADATA_FILENAME

            torch.save(checkpoint, folder / _METADATA_FILENAME)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        folder = self._replica_folder(Path(self.broadcast(checkpoint_path)))
        if not folder.is_dir():  # ModelParallelStrategy's own file
            return super().load_checkpoint(checkpoint_path, weights_only)
        # Lightning's own loader of a DCP folder (private: imported here, so that a Lightning
        # that moves it breaks this strategy only)
        from lightning.fabric.strategies.model_parallel import _load_checkpoint

        state: dict[str, Any] = {"state_dict": self.model}
        state.update({f"optimizer_{k}": opt for k, opt in enumerate(self.optimizers)})
        assert self.lightning_module is not None
        # DCP loads over all ranks, each from its replica's folder
        return _load_checkpoint(
            path=folder,
            state=state,
            strict=self.lightning_module.strict_loading,
            optimizer_states_from_list=True,
            weights_only=weights_only,
        )

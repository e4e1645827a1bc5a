"""Hugging Face Accelerate without DDP: :class:`DecentralizedAccelerator`.

An ``Accelerator`` under torchrun wraps every prepared model in ``DistributedDataParallel``,
whose all-reduce would average the gradients before our optimizer averages the parameters: the
gossip would then mix identical copies, and the job would pay for both. This subclass prepares
models as Accelerate prepares them for evaluation (mixed precision and ``torch.compile`` as
configured, no DDP), leaves a model that is already on the accelerator's device where it is
(``model.to("cpu:0")`` would copy every parameter out of the optimizer's buffers), and makes
``save_state``/``load_state`` keep each rank's own model and optimizer state
(:mod:`decent_optim.integrations.common`). Everything else -- data loader sharding,
``accumulate()``, ``backward``, ``clip_grad_norm_``, ``gather`` -- is Accelerate's.

Usage: construct ``DecentralizedAccelerator(...)`` where the script built ``Accelerator(...)``,
and a decent_optim optimizer instead of the torch one; see ``docs/with_accelerate.rst``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from decent_optim.integrations.common import (
    consensus,
    decentralized,
    load_models_and_optimizers,
    on_device,
    save_models_and_optimizers,
    unwrap,
)

__all__ = ["PREFIX", "DecentralizedAccelerator"]

#: per-rank files in a checkpoint folder: ``decent_optim-rank{r}-of-{n}.pt``
PREFIX = "decent_optim-"

_SHARDED = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)


class DecentralizedAccelerator(Accelerator):
    """An ``Accelerator`` for decentralized optimizers: no DDP, per-rank checkpoints.

    Takes ``Accelerator``'s arguments. Sharded set-ups (FSDP, DeepSpeed, Megatron-LM) are
    refused: they split the model across ranks, whereas here every rank holds all of it.

    * ``prepare(model, optimizer, ...)``: as Accelerate's, but the model is not wrapped in
      ``DistributedDataParallel``; the optimizer must be a decent_optim one, which averages
      the parameters itself.
    * ``save_state(dir)``: Accelerate's files hold the *consensus* model (the mean over the
      ranks; a collective), and every rank also writes ``decent_optim-rank{r}-of-{n}.pt`` with
      its own model and optimizer state. ``load_state(dir)`` restores that file on every rank,
      so training continues exactly as if it had not stopped.
    * To evaluate or export the consensus model, use ``opt.averaged(model)``, through
      ``decent_optim.unwrap(opt)`` on the prepared optimizer.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.distributed_type in _SHARDED:
            raise ValueError(
                f"DecentralizedAccelerator cannot run with {self.distributed_type}: it shards the "
                "model across ranks, whereas decentralized training keeps a whole copy on every "
                "rank. Use a plain multi-process launch (torchrun or `accelerate launch` without "
                "an FSDP/DeepSpeed config)"
            )

    def prepare_model(
        self,
        model: torch.nn.Module,
        device_placement: bool | None = None,
        evaluation_mode: bool = False,
    ) -> torch.nn.Module:
        """Accelerate's preparation without the DDP wrapper (``evaluation_mode`` is implied)."""
        if on_device(model, self.device):
            device_placement = False
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)

    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any
    ) -> str:
        """Accelerate's ``save_state`` with the consensus model, plus this rank's own file."""
        opts = decentralized(self._optimizers)
        if not opts:
            return str(super().save_state(output_dir, safe_serialization, **kwargs))
        only = self._models[0] if len(self._models) == 1 else None
        with consensus(opts, only):
            location = super().save_state(output_dir, safe_serialization, **kwargs)
        save_models_and_optimizers(os.path.join(location, PREFIX), self._models, opts)
        return str(location)

    def end_training(self) -> None:
        """Finish every optimizer's round in flight, then Accelerate's ``end_training``.

        Accelerate destroys the process group here; a gossip round still in flight (the last
        step launched one) would then be torn down under the peers' transfers, which can hang
        the exit. The parameters end fully mixed, as after ``synchronize()``.
        """
        for opt in decentralized(self._optimizers):
            opt.synchronize()
        super().end_training()

    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        """Accelerate's ``load_state``, then this rank's own model and optimizer state."""
        opts = decentralized(self._optimizers)
        if not opts:
            super().load_state(input_dir, load_kwargs, **kwargs)
            return
        resolved: list[str] = []  # the folder Accelerate picked (also with automatic naming)
        hook = self.register_load_state_pre_hook(lambda models, path: resolved.append(path))
        # Accelerate's optimizer file is rank 0's, which the other ranks' optimizers refuse:
        # they skip it here and load their own file below
        ours = [w for w in self._optimizers if unwrap(w) is not None]
        for wrapper in ours:
            wrapper.load_state_dict = _skip
        try:
            super().load_state(input_dir, load_kwargs, **kwargs)
        finally:
            hook.remove()
            for wrapper in ours:
                del wrapper.load_state_dict
        load_models_and_optimizers(os.path.join(resolved[0], PREFIX), self._models, opts)


def _skip(state_dict: dict[str, Any]) -> None:
    """Stands in for an optimizer's ``load_state_dict`` while Accelerate loads rank 0's file."""

"""Hugging Face ``Trainer`` with a decentralized optimizer: :class:`DecentralizedTrainer`.

The stock Trainer, under torchrun, wraps the model in ``DistributedDataParallel`` (through
Accelerate), saves the optimizer from rank 0 only and evaluates each rank's own copy. With a
decent_optim optimizer that means an all-reduce on top of the gossip (the copies stay
identical, so the gossip averages nothing), a resume that puts rank 0's optimizer state on every
rank, and metrics of no particular model. This subclass changes exactly those parts:

* the model is prepared without DDP (:class:`~decent_optim.integrations.accelerate.DecentralizedAccelerator`),
  and is not moved to a device it is already on (a copy would take its parameters out of the
  optimizer's buffers);
* each checkpoint folder holds, besides the Trainer's files, one
  ``decent_optim-rank{r}-of-{n}.pt`` per rank with that rank's model and optimizer state, which
  ``train(resume_from_checkpoint=...)`` restores on every rank; the Trainer's own model file
  holds the consensus model;
* ``evaluate``, ``predict`` and ``save_model`` run on the consensus model (the mean over the
  ranks, see ``averaged()``), on every rank together;
* the loss is normalised by this rank's own token count (``average_tokens_across_devices``
  off): with no gradient all-reduce there is nothing to correct for, and the count's all-gather
  would make every step wait for every rank.

The optimizer must be a decent_optim one: pass ``optimizers=(opt, scheduler)`` or
``optimizer_cls_and_kwargs=(decent_optim.DecentralizedAdamW, {...})``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from transformers import Trainer

from decent_optim.integrations.accelerate import PREFIX, DecentralizedAccelerator
from decent_optim.integrations.common import (
    consensus,
    decentralized,
    load_models_and_optimizers,
    on_device,
    save_models_and_optimizers,
)
from decent_optim.optim.engine import DecentralizedOptimizer

__all__ = ["DecentralizedTrainer"]

SCHEDULER_NAME = "scheduler.pt"  # the Trainer's name for the scheduler's file


class DecentralizedTrainer(Trainer):
    """A ``Trainer`` for decent_optim optimizers under torchrun; takes ``Trainer``'s arguments.

    See the module docstring for what differs from ``Trainer``. ``evaluate``, ``predict`` and
    ``save_model`` are collectives once training has begun: call them on every rank (the
    Trainer does, for its own evaluations and checkpoints).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.args.average_tokens_across_devices = False

    # -- no DDP, no needless move ---------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # The Trainer builds a plain Accelerator itself; this one differs only in methods
        self.accelerator.__class__ = DecentralizedAccelerator

    def _move_model_to_device(self, model: torch.nn.Module, device: torch.device) -> None:
        if not on_device(model, device):
            super()._move_model_to_device(model, device)

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(model)
        if self.args.world_size > 1 and not decentralized([optimizer]):
            raise TypeError(
                f"DecentralizedTrainer averages no gradients, so its optimizer must be a "
                f"decent_optim one, got {type(optimizer).__name__}; pass "
                "optimizer_cls_and_kwargs=(decent_optim.DecentralizedAdamW, {'lr': ...}) or "
                "optimizers=(decent_optim.DecentralizedAdamW(model.parameters(), ...), None)"
            )
        return optimizer

    def _optimizers(self) -> list[DecentralizedOptimizer]:
        return decentralized([self.optimizer]) if self.optimizer is not None else []

    def _module(self) -> torch.nn.Module:
        if self.model is None:
            raise RuntimeError("DecentralizedTrainer has no model; pass model= to it")
        return self.model

    @contextlib.contextmanager
    def _consensus(self) -> Iterator[None]:
        with consensus(self._optimizers(), self.model):
            yield

    # -- consensus model for evaluation and export ------------------------------------------------
    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        with self._consensus():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        with self._consensus():
            return super().predict(*args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        with self._consensus():
            super().save_model(output_dir, _internal_call)

    # -- per-rank checkpoints ---------------------------------------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        opts = self._optimizers()
        if not opts:
            super()._save_optimizer_and_scheduler(output_dir)
            return
        save_models_and_optimizers(os.path.join(output_dir, PREFIX), [self._module()], opts)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        opts = self._optimizers()
        if checkpoint is None or not opts:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        load_models_and_optimizers(os.path.join(checkpoint, PREFIX), [self._module()], opts)
        scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler_file):
            state = torch.load(scheduler_file, map_location="cpu", weights_only=True)
            self.lr_scheduler.load_state_dict(state)

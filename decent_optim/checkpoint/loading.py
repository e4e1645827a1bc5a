"""``load``: every rank resumes from the newest complete checkpoint, at whatever world size it has.

A collective, called on every rank after building the model and the optimizer, before training:

1. rank 0 finds the newest complete checkpoint (:func:`~decent_optim.checkpoint.directory.latest`)
   and removes the step folders a killed save left without a manifest; every rank takes rank 0's
   choice (one all-gather), so no two ranks resume from different steps;
2. with the world size and topology it was saved with, each rank reads its own file and the run
   continues exactly as if it had not stopped; with another world size (or topology), each rank
   builds its start from the saved files by the rule of :mod:`~decent_optim.checkpoint.resize`
   (``"consensus"`` by default), reading them one at a time;
3. every file read is checked to be the file of that rank, step, run and optimizer class the
   manifest names, and the ranks agree that all went well before the optimizer is touched
   (:func:`~decent_optim.optim.agreement.agree`); then the model's and the optimizer's
   ``load_state_dict`` run (the optimizer's cross-checks the round counters, see
   :mod:`decent_optim.optim.checkpoint`).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from decent_optim.checkpoint import directory, resize
from decent_optim.gossip import gather_objects
from decent_optim.optim.agreement import Account, agree
from decent_optim.optim.startup import topology_key
from decent_optim.wrappers import unwrap

__all__ = ["HEADER", "Resumed", "load"]

#: the key of the header in every rank file
HEADER = "decent_optim_checkpoint"


@dataclass
class Resumed:
    """What :func:`load` resumed from."""

    step: int  #: the step the checkpoint was saved at; 0 when there was none
    extra: Any  #: the ``extra=`` given to ``save`` (by the rule, as the model), or None
    folder: Path | None  #: the step folder, or None when there was no checkpoint
    saved_world_size: int | None  #: the world size that saved it
    source: str | None  #: ``"own"`` (this rank's file) or the resize rule used


def load(
    root: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: Any,
    *,
    rule: str = "consensus",
    step: int | None = None,
) -> Resumed:
    """Resume ``model`` and ``optimizer`` from the newest complete checkpoint under ``root``.

    A collective (module docstring). Returns ``Resumed(step=0, ...)`` when there is none yet, so
    a training script calls it unconditionally and continues from ``resumed.step``.

    Args:
        root: the folder given to ``save``.
        model, optimizer: built as for the saved run (the same model and optimizer class), at
            any world size.
        rule: what each rank starts from when the world size changed: ``"consensus"`` (the mean
            of the saved copies) or ``"rank"`` (old rank ``r mod N``'s copy); see
            :mod:`~decent_optim.checkpoint.resize`.
        step: load this step's checkpoint instead of the newest (an error if it is incomplete).
    """
    if rule not in resize.RULES:
        raise ValueError(f"rule must be one of {resize.RULES}, got {rule!r}")
    opt = unwrap(optimizer)
    group, device = opt._where
    folder_root = Path(root).resolve()
    choice: tuple[str, dict[str, Any]] | None = None
    failure = None
    if opt.rank == 0:
        try:
            found = directory.latest(folder_root, step)
            directory.clean(folder_root, keep=found[0] if found else None)
            choice = None if found is None else (str(found[0]), asdict(found[1]))
        except Exception as err:
            failure = f"{type(err).__name__}: {err}"
    if group is not None:
        choice, failure = gather_objects((choice, failure), group)[0]
    if failure is not None:
        raise RuntimeError(f"rank 0 could not look for checkpoints in {root}: {failure}")
    if choice is None:
        if step is not None:
            raise FileNotFoundError(f"no complete checkpoint of step {step} in {root}")
        return Resumed(0, None, None, None, None)
    folder, manifest = Path(choice[0]), directory.Manifest(**choice[1])
    account, own, loaded, source = Account(), None, None, None
    try:
        loaded, source = _read(folder, manifest, opt, rule)
        model.load_state_dict(loaded["model"])
    except Exception as err:
        account.error, own = (type(err).__name__, str(err)), err
    agree(account, group, device, "decent_optim.checkpoint.load", own=own)
    assert loaded is not None  # agree() raised otherwise
    state = loaded["optimizer"]
    opt.load_state_dict(state if source == "own" else resize.retarget(state))
    return Resumed(manifest.step, loaded["extra"], folder, manifest.world_size, source)


def _read(
    folder: Path, manifest: directory.Manifest, opt: Any, rule: str
) -> tuple[dict[str, Any], str]:
    """This rank's start: its own file, or the rule's merge of the saved files."""
    if manifest.optimizer != type(opt).__name__:
        raise ValueError(
            f"the checkpoint in {folder} was saved by {manifest.optimizer}, this optimizer is "
            f"{type(opt).__name__}: build the optimizer of the saved run"
        )
    paths = [folder / name for name in manifest.files]

    def check(old_rank: int, contents: Any) -> None:
        expected = {
            "step": manifest.step,
            "world_size": manifest.world_size,
            "rank": old_rank,
            "run": manifest.run,
            "optimizer_class": manifest.optimizer,
        }
        header = contents.get(HEADER) if isinstance(contents, dict) else None
        if header != expected:
            raise ValueError(
                f"{paths[old_rank]} is not the file the manifest names (rank {old_rank} of "
                f"{manifest.world_size}, step {manifest.step}, run {manifest.run!r}): its header "
                f"says {header}. The folder mixes files of different runs or steps; resume from "
                "another checkpoint (load(step=...)) or remove this one"
            )

    same_world = manifest.world_size == opt.world_size
    if same_world and manifest.topology == topology_key(opt.topology):
        contents = resize.read(paths[opt.rank])
        check(opt.rank, contents)
        return contents, "own"
    return resize.merged(paths, opt.rank, rule, check=check), rule

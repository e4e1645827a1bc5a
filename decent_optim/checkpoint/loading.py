"""``load``: every rank resumes from the newest complete checkpoint, at whatever world size it has.

A collective, called on every rank after building the model and the optimizer, before training:

1. each rank first finishes its own save in flight into the folder (:func:`.writers.flush`), so
   a load never reads around it, nor removes the step folder it writes; rank 0 finds the newest
   complete checkpoint (:func:`~decent_optim.checkpoint.directory.latest`); every rank takes
   rank 0's choice (one all-gather, bounded by the optimizer's ``timeout=``: a rank that never
   calls ``load`` is named in a :class:`~decent_optim.gossip.GossipError` on the others), so no
   two ranks resume from different steps; then rank 0 removes the step folders a killed or
   failed save left without a manifest;
2. with the world size and topology it was saved with, each rank reads its own file and the run
   continues exactly as if it had not stopped; with another world size (or topology), each rank
   builds its start from the saved files by the rule of :mod:`~decent_optim.checkpoint.resize`
   (``"consensus"`` by default), reading them one at a time;
3. every file read is checked to be the file of that rank, step, run and optimizer class the
   manifest names, and of this model's layout (a file that cannot be read is named, with the
   earlier steps to load instead); the model's ``load_state_dict`` runs, and the ranks agree
   that all went well before the optimizer is touched
   (:func:`~decent_optim.optim.agreement.agree`, bounded the same way); then the optimizer's
   ``load_state_dict`` runs (it cross-checks the round counters, see
   :mod:`decent_optim.optim.checkpoint`).

Sharded models (DTensor parameters) are refused at once, on every rank
(:mod:`~decent_optim.checkpoint.refusals`).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from decent_optim.checkpoint import directory, lineage, ownership, refusals, resize, writers
from decent_optim.checkpoint.directory import HEADER
from decent_optim.gossip import Arrival, gather_objects
from decent_optim.optim.agreement import Account, agree
from decent_optim.optim.startup import topology_key
from decent_optim.wrappers import unwrap

__all__ = ["HEADER", "Resumed", "load"]

#: what a wait in ``load`` usually means, for its GossipError
_WAIT_HINT = (
    "Every rank must call decent_optim.checkpoint.load() at the same point, after building the "
    "optimizer; a rank may also have died, or be slow to read the folder (a shared filesystem "
    "every rank sees). Pass a longer timeout= to the optimizer to wait longer"
)


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
    if step is not None:
        refusals.check_step(step)
    opt = unwrap(optimizer)
    refusals.refuse_sharded("load", [*model.parameters(), *_opt_params(opt)])
    refusals.refuse_inside_averaged("load", opt)
    folder_root = Path(root).resolve()
    refusals.refuse_not_a_root(folder_root)
    group, device = opt._where
    timeout: datetime.timedelta | None = getattr(opt._rounds.gossip, "timeout", None)
    flushed = writers.flush(folder_root)  # this process's save in flight, finished first
    failure = None if flushed is None else str(flushed)
    choice: tuple[str, dict[str, Any]] | None = None
    if opt.rank == 0 and failure is None:
        try:
            found = directory.latest(folder_root, step)
            choice = None if found is None else (str(found[0]), asdict(found[1]))
        except Exception as err:
            failure = (
                f"rank 0 could not look for checkpoints in {root}: {type(err).__name__}: {err}"
            )
    # rank 0 names the lineage the ranks save under from here on (see .lineage)
    mine = (choice, failure, lineage.draw() if opt.rank == 0 else None)
    everyone = [mine]
    if group is not None:
        what = "decent_optim.checkpoint.load"
        arrival = Arrival(what, group)
        everyone = gather_objects(mine, group, timeout, what, _WAIT_HINT, arrival)
    failed = [f"rank {r}: {text}" for r, (_, text, _) in enumerate(everyone) if text is not None]
    if failed:
        raise RuntimeError(
            f"decent_optim.checkpoint.load from {root} failed before loading anything ("
            + "; ".join(failed)
            + ")"
        ) from flushed
    choice, _, name = everyone[0]
    lineage.begin(folder_root, str(name))
    if opt.rank == 0:  # every rank has finished its saves in flight: none is still writing
        directory.clean(folder_root, keep=Path(choice[0]) if choice else None)
    ownership.own(folder_root, opt, None)
    if choice is None:
        if step is not None:
            raise FileNotFoundError(f"no complete checkpoint of step {step} in {root}")
        return Resumed(0, None, None, None, None)
    folder, manifest = Path(choice[0]), directory.Manifest(**choice[1])
    account, own, loaded, source = Account(), None, None, None
    try:
        loaded, source = _read(folder, manifest, opt, rule)
        ownership.check_layout(loaded.get("model"), model, f"the checkpoint in {folder}")
        model.load_state_dict(loaded["model"])
    except Exception as err:
        account.error, own = (type(err).__name__, str(err)), err
    agree(
        account,
        group,
        device,
        "decent_optim.checkpoint.load",
        own=own,
        timeout=timeout,
        wait_hint=_WAIT_HINT,
    )
    assert loaded is not None  # agree() raised otherwise
    state = loaded["optimizer"]
    opt.load_state_dict(state if source == "own" else resize.retarget(state))
    return Resumed(manifest.step, loaded["extra"], folder, manifest.world_size, source)


def _opt_params(opt: Any) -> list[Any]:
    return [p for g in opt.param_groups for p in g["params"]]


def _reader(manifest: directory.Manifest, folder: Path) -> Any:
    """:func:`resize.read`, raising an error that names the file, the step and what to load
    instead when a file cannot be read (damaged after the manifest was written)."""

    def read(path: Any) -> Any:
        try:
            return resize.read(path)
        except Exception as err:
            earlier = [s for s in directory.complete_steps(folder.parent) if s < manifest.step]
            instead = (
                f"load an earlier checkpoint: decent_optim.checkpoint.load(root, model, opt, "
                f"step={earlier[0]}) (complete ones here: steps {earlier[:4]}, newest first)"
                if earlier
                else "there is no earlier complete checkpoint in that folder: restore the file "
                "from a copy, or move the step folder away to start from scratch"
            )
            raise ValueError(
                f"{path}, a file of the checkpoint of step {manifest.step}, cannot be read "
                f"({type(err).__name__}: {err}): it was damaged (cut short or overwritten) "
                f"after the checkpoint was committed. Nothing was loaded; {instead}"
            ) from err

    return read


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
    read = _reader(manifest, folder)

    def check(old_rank: int, contents: Any) -> None:
        expected = {
            "step": manifest.step,
            "world_size": manifest.world_size,
            "rank": old_rank,
            "run": manifest.run,
            "optimizer_class": manifest.optimizer,
            "save": manifest.save,
        }
        header = contents.get(HEADER) if isinstance(contents, dict) else None
        if isinstance(header, dict):  # files saved before the lineage was recorded lack it
            header = {"save": "", **header}
        if header != expected:
            raise ValueError(
                f"{paths[old_rank]} is not the file the manifest names (rank {old_rank} of "
                f"{manifest.world_size}, step {manifest.step}, run {manifest.run!r}): its header "
                f"says {header}. The folder mixes files of different runs or steps; resume from "
                "another checkpoint (load(step=...)) or remove this one"
            )

    same_world = manifest.world_size == opt.world_size
    if same_world and manifest.topology == topology_key(opt.topology):
        contents = read(paths[opt.rank])
        check(opt.rank, contents)
        return contents, "own"
    return resize.merged(paths, opt.rank, rule, check=check, load=read), rule

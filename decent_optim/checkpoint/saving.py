"""``save``: one call per rank writes its file of a step folder; rank 0 commits it.

Each rank writes ``{"model": ..., "optimizer": ..., "extra": ...}`` plus a header (step, world
size, rank, run, optimizer class) with ``torch.save`` to its own file, atomically
(:mod:`~decent_optim.checkpoint.directory`). Rank 0 then waits for every rank's file to appear
under its final name and writes the manifest. No collective runs while saving, so a save never
waits on a peer's gossip round, and a background save needs no communication from its thread.

Rank 0 of several commits in a thread: a peer that died before writing its file must not hold
training (the run should fail at its next gossip round and restart, not wait here). The
thread gives up after ``timeout`` seconds, or 30 s after the main thread has ended (a rank that
fails exits promptly). With live membership (``membership=``) it also gives up, with a
warning and no error, once the group has changed, or a member started a change, for half the
membership's ``timeout`` (:func:`decent_optim.optim.live.superseded`): a lost member's file
never comes, the step folder stays without a manifest (the next ``load`` removes it), and the
survivors' next saves, at their new world size, are committed as usual.

``background=True``: the call copies the state to CPU memory (a snapshot: training goes on
changing the parameters) and returns; a thread writes the copy and, on rank 0, commits. The
next ``save``, :func:`wait` and ``load`` first wait for the thread in flight and raise its
error, if any, so at most one save per folder is in flight and nothing fails unseen. The thread
is not a daemon: the interpreter finishes the write before it exits, and reports on stderr what
nobody waited for (:mod:`~decent_optim.checkpoint.writers`).

Before anything is written, ``save`` refuses what would lose or mix checkpoints
(:mod:`~decent_optim.checkpoint.refusals`, :mod:`~decent_optim.checkpoint.ownership`). A step
committed by another trajectory (saved again after ``load(step=...)`` went back) is un-committed
before the first new file is written, and committed again only with every rank's new file
(:mod:`~decent_optim.checkpoint.lineage`). A write
that fails (a full disk) raises :class:`~decent_optim.checkpoint.directory.WriteError` naming the
file and the step; the step folder never gets a manifest, so the previous checkpoints stay the
newest complete ones, and what is left of it is removed.
"""

from __future__ import annotations

import functools
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from decent_optim.checkpoint import directory, lineage, ownership, refusals, resize, writers
from decent_optim.checkpoint.writers import wait
from decent_optim.optim.live import superseded
from decent_optim.optim.startup import topology_key
from decent_optim.wrappers import unwrap

__all__ = ["save", "wait"]


def _snapshot(value: Any) -> Any:
    """A copy of every tensor in ``value`` in CPU memory, the rest kept."""
    if isinstance(value, Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_snapshot(v) for v in value)
    return value


def _params(model: torch.nn.Module, opt: Any) -> list[Any]:
    return [*model.parameters(), *(p for g in opt.param_groups for p in g["params"])]


def save(
    root: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: Any,
    *,
    step: int,
    extra: Any = None,
    background: bool = False,
    keep_last: int | None = 2,
    run: str | None = None,
    timeout: float = 600.0,
) -> Path:
    """Save this rank's model and optimizer as its part of the checkpoint of ``step``.

    Call it on every rank at the same step. Returns the step folder; it is a checkpoint once
    rank 0 has committed its manifest: when :func:`wait` returns on rank 0 (or this call, in a
    world of one without ``background``).

    Args:
        root: the checkpoint folder, the same for every rank (a shared filesystem across nodes),
            of this model and optimizer only (another model's save into it is refused).
        model: the module whose parameters ``optimizer`` trains (not sharded: see
            docs/large_models for sharded models).
        optimizer: a decent_optim optimizer, or a framework's wrapper around one.
        step: the training step, which names the folder and is returned by ``load``.
        extra: anything else of this rank to restore (scheduler, data position, RNG states):
            what ``torch.load(weights_only=True)`` reads back -- tensors, numbers, strings,
            lists, tuples and dicts, no numpy values (checked here, by a round trip in memory).
        background: snapshot to CPU memory and write in a thread (module docstring).
        keep_last: rank 0 removes older complete checkpoints beyond this many, a whole number
            >= 1 (None: keep all).
        run: a name of the run, checked at load (default: torchrun's ``TORCHELASTIC_RUN_ID``).
        timeout: seconds rank 0 waits for the other ranks' files before giving up the commit
            (in a thread when there are other ranks: :func:`wait` waits for it).
    """
    refusals.check_step(step)
    refusals.check_keep_last(keep_last)
    opt = unwrap(optimizer)
    refusals.refuse_sharded("save", _params(model, opt))
    refusals.refuse_inside_averaged("save", opt)
    refusals.check_extra(extra)
    folder_root = Path(root).resolve()
    ownership.refuse_other_owner(folder_root, opt)
    wait(folder_root)  # one save in flight per folder; raises the previous one's error
    rank, world_size = opt.rank, opt.world_size
    folder = directory.step_folder(folder_root, step)
    mine = folder / directory.rank_file(rank, world_size)
    ownership.refuse_other_file(mine, model, opt, resize.read)
    ownership.own(folder_root, opt, step)
    run = os.environ.get("TORCHELASTIC_RUN_ID", "") if run is None else run
    header = {"step": step, "world_size": world_size, "rank": rank, "run": run}
    header["optimizer_class"] = type(opt).__name__
    header["save"] = save_as = lineage.current(folder_root)
    payload: dict[str, Any] | None = {
        directory.HEADER: header,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "extra": extra,
    }
    manifest = directory.Manifest(
        step=step,
        world_size=world_size,
        topology=topology_key(opt.topology),
        optimizer=type(opt).__name__,
        files=[directory.rank_file(r, world_size) for r in range(world_size)],
        sizes=[],
        run=run,
        save=save_as,
    )

    if background:
        payload = _snapshot(payload)
    else:  # this rank's file now; rank 0's commit may still have to wait for the others
        _write(folder_root, manifest, rank, payload, keep_last, timeout, commit=False)
        if world_size == 1:
            return _write(folder_root, manifest, rank, None, keep_last, timeout)
        if rank != 0:
            writers.saved_into(folder_root, folder, commits=False)
            return folder
        payload = None
    writers.saved_into(folder_root, folder, commits=rank == 0)
    job = functools.partial(_write, folder_root, manifest, rank, payload, keep_last, timeout)
    job.keywords["changed"] = superseded(opt)
    writers.start(folder_root, job)
    return folder


def _main_thread_gone(since: list[float]) -> bool:
    """True once the main thread has been finished for :data:`.writers.EXIT_GRACE_S` seconds."""
    if threading.main_thread().is_alive():
        return False
    since.append(time.monotonic())
    return time.monotonic() - since[0] > writers.EXIT_GRACE_S


def _not_saved(root: Path, folder: Path, err: OSError) -> directory.WriteError:
    """The error of a failed write of step ``folder``: what failed, what is intact, what to do."""
    kept = [s for s in directory.complete_steps(root) if directory.step_folder(root, s) != folder]
    intact = (
        f"the complete checkpoints before it are intact (steps {kept[:4]}, newest first)"
        if kept
        else f"there is no other complete checkpoint in {root}"
    )
    failure = directory.WriteError(
        f"decent_optim.checkpoint.save: the checkpoint in {folder} was not saved: {err}. That "
        "folder has no manifest, so it is never loaded (what is left of it is removed here or "
        f"by the next load()); {intact}. Free disk space or keep fewer checkpoints "
        "(keep_last=), then save again"
    )
    failure.errno = err.errno
    return failure


def _write(
    root: Path,
    manifest: directory.Manifest,
    rank: int,
    payload: Any,
    keep_last: int | None,
    timeout: float,
    *,
    commit: bool = True,
    changed: Callable[[], bool] = lambda: False,
) -> Path:
    """Write this rank's file (``payload`` None: written already); on rank 0 with ``commit``,
    wait for the others' and commit the manifest, unless the group ``changed`` meanwhile."""
    folder = directory.step_folder(root, manifest.step)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise directory.WriteError(
            f"decent_optim.checkpoint.save: could not create the step folder {folder} "
            f"({type(err).__name__}: {err}); the checkpoint folder must be a folder every rank "
            "can write to. Nothing was written"
        ) from err
    if payload is not None:
        try:
            lineage.uncommit_other(folder, manifest.save)  # a step of another trajectory
            directory.save_file(folder / manifest.files[rank], payload)
        except directory.WriteError as err:
            try:
                folder.rmdir()  # only if empty: the other ranks' files are theirs to remove
            except OSError:
                pass
            raise _not_saved(root, folder, err) from err
    if rank == 0 and commit:
        gone: list[float] = []
        try:
            manifest.sizes = directory.wait_for_files(
                folder,
                manifest.files,
                timeout,
                give_up=lambda: _main_thread_gone(gone) or changed(),
                accept=lineage.written_by(manifest.save, resize.read),  # not an earlier save's
            )
        except TimeoutError:
            if not changed():
                raise
            warnings.warn(
                f"decent_optim.checkpoint.save: the checkpoint of step {manifest.step} in "
                f"{folder} is not committed: the group changed (live membership) before every "
                "rank had saved it. The complete checkpoints before it stay the newest; "
                "the next load() removes this folder, and the next save() commits at the new "
                "world size",
                UserWarning,
                stacklevel=1,
            )
            return folder
        try:
            directory.commit_manifest(folder, manifest)
        except directory.WriteError as err:
            if not (folder / directory.MANIFEST).exists():  # every file is in: none is written
                shutil.rmtree(folder, ignore_errors=True)
            raise _not_saved(root, folder, err) from err
        if keep_last is not None:
            directory.prune(root, keep_last)
    return folder

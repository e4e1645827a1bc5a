"""``save``: one call per rank writes its file of a step folder; rank 0 commits it.

Each rank writes ``{"model": ..., "optimizer": ..., "extra": ...}`` plus a header (step, world
size, rank, run, optimizer class) with ``torch.save`` to its own file, atomically
(:mod:`~decent_optim.checkpoint.directory`). Rank 0 then waits for every rank's file to appear
under its final name and writes the manifest. No collective runs while saving, so a save never
waits on a peer's gossip round, and a background save needs no communication from its thread.

Rank 0 of several commits in a thread: a peer that died before writing its file must not hold
training (the run should fail at its next gossip round and restart, not wait here). The
thread gives up after ``timeout`` seconds, or 30 s after the main thread has ended (a rank that
fails exits promptly).

``background=True``: the call copies the state to CPU memory (a snapshot: training goes on
changing the parameters) and returns; a thread writes the copy and, on rank 0, commits. The
next ``save`` (or :func:`wait`) first waits for the thread in flight and raises its error, if
any, so at most one save per folder is in flight and nothing fails unseen. The thread is not a
daemon: the interpreter finishes the write before it exits.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from decent_optim.checkpoint import directory
from decent_optim.optim.startup import topology_key
from decent_optim.wrappers import unwrap

__all__ = ["save", "wait"]

#: per root folder, the background save in flight
_WRITERS: dict[Path, _Writer] = {}


class _Writer(threading.Thread):
    def __init__(self, job: Any) -> None:
        super().__init__(name="decent_optim checkpoint writer")
        self._job = job
        self.error: BaseException | None = None
        self.result: Path | None = None

    def run(self) -> None:
        try:
            self.result = self._job()
        except BaseException as err:  # handed to the training thread by wait()
            self.error = err


def wait(root: str | os.PathLike[str]) -> Path | None:
    """Wait for the background save into ``root`` still in flight; re-raise its error.

    Returns the step folder it wrote, or None when nothing was in flight.
    """
    writer = _WRITERS.pop(Path(root).resolve(), None)
    if writer is None:
        return None
    writer.join()
    if writer.error is not None:
        raise RuntimeError(f"the background checkpoint save into {root} failed") from writer.error
    return writer.result


def _snapshot(value: Any) -> Any:
    """A copy of every tensor in ``value`` in CPU memory, the rest kept."""
    if isinstance(value, Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_snapshot(v) for v in value)
    return value


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
        root: the checkpoint folder, the same for every rank (a shared filesystem across nodes).
        model: the module whose parameters ``optimizer`` trains.
        optimizer: a decent_optim optimizer, or a framework's wrapper around one.
        step: the training step, which names the folder and is returned by ``load``.
        extra: anything else of this rank to restore (scheduler, data position, RNG states):
            tensors, numbers, strings, lists and dicts.
        background: snapshot to CPU memory and write in a thread (module docstring).
        keep_last: rank 0 removes older complete checkpoints beyond this many (None: keep all).
        run: a name of the run, checked at load (default: torchrun's ``TORCHELASTIC_RUN_ID``).
        timeout: seconds rank 0 waits for the other ranks' files before giving up the commit
            (in a thread when there are other ranks: :func:`wait` waits for it).
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a whole number >= 0, got {step!r}")
    opt = unwrap(optimizer)
    rank, world_size = opt.rank, opt.world_size
    folder_root = Path(root).resolve()
    wait(folder_root)  # one save in flight per folder; raises the previous one's error
    run = os.environ.get("TORCHELASTIC_RUN_ID", "") if run is None else run
    header = {"step": step, "world_size": world_size, "rank": rank, "run": run}
    header["optimizer_class"] = type(opt).__name__
    payload: dict[str, Any] | None = {
        "decent_optim_checkpoint": header,
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
    )

    if background:
        payload = _snapshot(payload)
    else:  # this rank's file now; rank 0's commit may still have to wait for the others
        _write(folder_root, manifest, rank, payload, keep_last, timeout, commit=False)
        if rank != 0 or world_size == 1:
            if rank == 0:
                return _write(folder_root, manifest, rank, None, keep_last, timeout)
            return directory.step_folder(folder_root, step)
        payload = None
    job = functools.partial(_write, folder_root, manifest, rank, payload, keep_last, timeout)
    writer = _WRITERS[folder_root] = _Writer(job)
    writer.start()
    return directory.step_folder(folder_root, step)


#: seconds rank 0's commit still waits for the other ranks' files once the main thread ended
EXIT_GRACE_S = 30.0


def _main_thread_gone(since: list[float]) -> bool:
    """True once the main thread has been finished for :data:`EXIT_GRACE_S` seconds."""
    if threading.main_thread().is_alive():
        return False
    since.append(time.monotonic())
    return time.monotonic() - since[0] > EXIT_GRACE_S


def _write(
    root: Path,
    manifest: directory.Manifest,
    rank: int,
    payload: Any,
    keep_last: int | None,
    timeout: float,
    *,
    commit: bool = True,
) -> Path:
    """Write this rank's file (``payload`` None: written already); on rank 0 with ``commit``,
    wait for the others' and commit the manifest."""
    folder = directory.step_folder(root, manifest.step)
    folder.mkdir(parents=True, exist_ok=True)
    if payload is not None:
        directory.save_file(folder / manifest.files[rank], payload)
    if rank == 0 and commit:
        gone: list[float] = []
        manifest.sizes = directory.wait_for_files(
            folder, manifest.files, timeout, give_up=lambda: _main_thread_gone(gone)
        )
        directory.commit_manifest(folder, manifest)
        if keep_last is not None:
            directory.prune(root, keep_last)
    return folder

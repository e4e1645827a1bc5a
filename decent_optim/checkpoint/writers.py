"""Saves in flight: one writer thread per checkpoint folder, and no failure that goes unseen.

A background save (and rank 0's commit of a save of several ranks) runs in a :class:`Writer`
thread. Whatever comes next for that folder waits for it first and raises its error: the next
``save`` and :func:`wait`, and ``load``, which must neither read the folder nor remove the step
folder a save of this process is still writing (:func:`flush`).

A process that ends without any of them -- its script never called ``wait()`` -- is still told,
on stderr at exit (:func:`report_at_exit`): the interpreter first finishes the writers (they are
not daemons), then this hook names every save that failed, and every step folder this process
wrote into that is still not a checkpoint (no manifest) after ``EXIT_GRACE_S`` seconds
-- the sign of a rank that never saved that step (skipped when the script died of an exception,
so that a failing rank exits at once). The exit status cannot be changed after the script has
ended: call ``wait()`` at the end to get these as exceptions.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from decent_optim.checkpoint.directory import MANIFEST

__all__ = ["Writer", "flush", "report_at_exit", "saved_into", "start", "wait"]

#: per root folder, the writer in flight (until wait() or the next save takes it)
_WRITERS: dict[Path, Writer] = {}
#: per root folder, the step folder this process last wrote into and whether it commits it
_LAST: dict[Path, tuple[Path, bool]] = {}


class Writer(threading.Thread):
    """Runs ``job`` (writes a rank file, commits) and keeps its result or error."""

    def __init__(self, job: Callable[[], Path]) -> None:
        super().__init__(name="decent_optim checkpoint writer")
        self._job = job
        self.error: BaseException | None = None
        self.result: Path | None = None

    def run(self) -> None:
        try:
            self.result = self._job()
        except BaseException as err:  # handed to the training thread by wait()
            self.error = err


def saved_into(root: Path, folder: Path, *, commits: bool) -> None:
    """Record that this process writes into ``folder`` (rank 0: ``commits`` it)."""
    _LAST[root] = (folder, commits)


def start(root: Path, job: Callable[[], Path]) -> None:
    """Run ``job`` in a writer thread for ``root`` (the previous one was waited for)."""
    writer = _WRITERS[root] = Writer(job)
    writer.start()


def wait(root: str | os.PathLike[str]) -> Path | None:
    """Wait for the background save into ``root`` still in flight; re-raise its error.

    Returns the step folder it wrote, or None when nothing was in flight.
    """
    folder_root = Path(root).resolve()
    writer = _WRITERS.pop(folder_root, None)
    if writer is None:
        return None
    writer.join()
    if writer.error is not None:
        _LAST.pop(folder_root, None)  # reported here: nothing left for the exit check
        raise RuntimeError(
            f"the background checkpoint save into {root} failed: "
            f"{type(writer.error).__name__}: {writer.error}"
        ) from writer.error
    last = _LAST.get(folder_root)
    if last is not None and last[1]:  # committed by this process: nothing left to check
        del _LAST[folder_root]
    return writer.result


def flush(root: Path) -> RuntimeError | None:
    """Finish this process's save in flight into ``root``; return its error (from :func:`wait`)
    instead of raising it, or None."""
    try:
        wait(root)
    except RuntimeError as err:
        return err
    return None


def _complete(folder: Path) -> bool:
    return (folder / MANIFEST).is_file()


#: seconds rank 0's commit still waits for the other ranks' files once the main thread ended
#: (``saving``), and the other ranks' exit check for its manifest (:func:`report_at_exit`)
EXIT_GRACE_S = 30.0


def report_at_exit(grace: float | None = None) -> list[str]:
    """Print (and return) what this process's saves left undone; see the module docstring."""
    if grace is None:
        grace = EXIT_GRACE_S
    lines = []
    for root, writer in list(_WRITERS.items()):
        writer.join()  # finished already at interpreter exit: writers are not daemons
        del _WRITERS[root]
        if writer.error is not None:
            lines.append(
                f"the checkpoint save into {root} FAILED and nobody called "
                f"decent_optim.checkpoint.wait({str(root)!r}): "
                f"{type(writer.error).__name__}: {writer.error}"
            )
            _LAST.pop(root, None)  # said already
    if getattr(sys, "last_value", None) is not None:
        # the script died of an exception, which said enough: exit now, not after the grace
        _LAST.clear()
    deadline = time.monotonic() + grace
    for root, (folder, commits) in list(_LAST.items()):
        while not commits and not _complete(folder) and time.monotonic() < deadline:
            time.sleep(0.05)  # rank 0, another process, may still be committing it
        if not _complete(folder):
            lines.append(
                f"the checkpoint in {folder}, which this process saved into, was never "
                "committed (no manifest.json): some rank did not save that step, or rank 0 "
                "gave up waiting for it; load() will resume from an earlier checkpoint. Every "
                "rank must call decent_optim.checkpoint.save() at the same steps, and wait() "
                "before it exits"
            )
        del _LAST[root]
    for line in lines:
        sys.stderr.write(f"decent_optim.checkpoint: WARNING: {line}\n")
    sys.stderr.flush()
    return lines


atexit.register(report_at_exit)

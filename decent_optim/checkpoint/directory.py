"""The checkpoint directory: one folder per step, one file per rank, a manifest committed last.

Layout under the root folder every rank can see (a shared filesystem across nodes)::

    root/
      step-00000600/
        rank-00000-of-00004.pt     # written by rank 0, ... one per rank
        ...
        manifest.json              # written last, by rank 0, once every rank's file is there

Every file is written under a temporary name in the same folder, flushed to disk (``fsync``),
then renamed to its final name (``os.replace`` is atomic on POSIX), and the folder is synced so
that the rename itself survives a power cut. So a file under its final name is complete, and a
step folder is a checkpoint exactly when it holds ``manifest.json``: a process killed in the
middle of a save leaves a folder without it, which :func:`latest` skips and :func:`clean`
removes. A write that fails (a full disk) removes its temporary file and raises
:class:`WriteError`, an ``OSError``, whatever form the failure took inside ``torch.save``. The
manifest records the world size, step, topology, optimizer class, the save's lineage
(:mod:`.lineage`) and every rank's file with its size, which :func:`latest` checks again.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "HEADER",
    "MANIFEST",
    "Manifest",
    "WriteError",
    "clean",
    "commit_manifest",
    "complete_steps",
    "latest",
    "prune",
    "rank_file",
    "step_folder",
    "sync_folder",
    "wait_for_files",
    "write_atomically",
]

MANIFEST = "manifest.json"
#: the key of the header (step, world size, rank, run, optimizer class) in every rank file
HEADER = "decent_optim_checkpoint"
FORMAT = 1
_STEP_FOLDER = re.compile(r"^step-(\d+)$")


@dataclass
class Manifest:
    """What a committed checkpoint folder holds."""

    step: int
    world_size: int
    topology: str
    optimizer: str
    files: list[str]  # by rank
    sizes: list[int]  # bytes, by rank
    run: str = ""
    format: int = FORMAT
    save: str = ""  # the lineage of the save (:mod:`.lineage`); "" before it was recorded


def step_folder(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def rank_file(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.pt"


def sync_folder(folder: Path) -> None:
    """Make the entries of ``folder`` (renames, removals) durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class WriteError(OSError):
    """Writing a checkpoint file failed (disk full, quota, I/O error); nothing was replaced."""


def _cause(err: BaseException) -> OSError | None:
    """The OS error behind a failed write: ``err`` itself, or what torch's zip writer turned
    into a RuntimeError (``unexpected pos 4096 vs 4000`` when a write came up short)."""
    if isinstance(err, OSError):
        return err
    if isinstance(err, RuntimeError):
        if isinstance(err.__context__, OSError):
            return err.__context__
        if any(mark in str(err) for mark in ("unexpected pos", "PytorchStreamWriter")):
            return OSError(f"torch.save: {err}")
    return None


def write_atomically(path: Path, write: Any) -> int:
    """Call ``write(file)`` on a temporary file next to ``path``, sync it, rename it to ``path``.

    Returns the file's size. A crash at any point leaves ``path`` as it was (absent or whole);
    a failed write removes the temporary file and raises :class:`WriteError`.
    """
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        with open(partial, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        size = partial.stat().st_size
        os.replace(partial, path)
    except BaseException as err:
        try:
            partial.unlink(missing_ok=True)
        except OSError:
            pass  # the error below matters more; a left partial file is never loaded
        cause = _cause(err)
        if cause is None:
            raise
        failure = WriteError(
            f"writing {path} failed (disk full or write failed: {type(err).__name__}: {err}); "
            f"{path.name} was left as it was and the partial file was removed"
        )
        failure.errno = cause.errno
        raise failure from err
    sync_folder(path.parent)
    return size


def wait_for_files(
    folder: Path,
    names: list[str],
    timeout: float,
    give_up: Any = lambda: False,
    accept: Any = lambda path: True,
) -> list[int]:
    """Wait until every file of ``names`` is in ``folder`` and ``accept``-ed (written by this
    save); returns their sizes.

    Raises TimeoutError naming the missing ones after ``timeout`` seconds, or as soon as
    ``give_up()`` is true.
    """
    deadline = time.monotonic() + timeout
    while True:
        missing = [n for n in names if not ((folder / n).is_file() and accept(folder / n))]
        if not missing:
            return [(folder / n).stat().st_size for n in names]
        if time.monotonic() > deadline or give_up():
            raise TimeoutError(
                f"the checkpoint in {folder} is not committed: "
                f"{len(missing)} rank file(s) are still missing ({', '.join(missing[:4])}...; "
                "a file an earlier save left there does not count). "
                "Every rank must call decent_optim.checkpoint.save() at the same step, and all "
                "ranks must write to one folder they all see (a shared filesystem)"
            )
        time.sleep(0.02)


def commit_manifest(folder: Path, manifest: Manifest) -> None:
    """Write the manifest last and atomically: from now on the folder is a checkpoint."""
    text = json.dumps(asdict(manifest), indent=1).encode()
    write_atomically(folder / MANIFEST, lambda f: f.write(text))


def read_manifest(folder: Path) -> Manifest | None:
    """The folder's manifest if it is a complete checkpoint (every file there, of its size)."""
    try:
        raw = json.loads((folder / MANIFEST).read_text())
        manifest = Manifest(**raw)
    except (OSError, ValueError, TypeError):
        return None
    if manifest.format != FORMAT or len(manifest.files) != manifest.world_size:
        return None
    for name, size in zip(manifest.files, manifest.sizes):
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            return None
    return manifest


def _step_folders(root: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every step folder under ``root``, newest first."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_FOLDER.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found, reverse=True)


def latest(root: Path, step: int | None = None) -> tuple[Path, Manifest] | None:
    """The newest complete checkpoint under ``root`` (or the one of ``step``), or None."""
    for saved, folder in _step_folders(root):
        if step is not None and saved != step:
            continue
        manifest = read_manifest(folder)
        if manifest is not None:
            return folder, manifest
        if (folder / MANIFEST).exists():
            warnings.warn(
                f"skipping the checkpoint in {folder}: its manifest names files that are missing "
                "or of another size (damaged after it was written)",
                stacklevel=2,
            )
    return None


def complete_steps(root: Path) -> list[int]:
    """The steps of the complete checkpoints under ``root``, newest first."""
    return [step for step, folder in _step_folders(root) if read_manifest(folder) is not None]


def clean(root: Path, keep: Path | None) -> list[Path]:
    """Remove the step folders without a manifest (saves a kill interrupted, or that failed),
    except ``keep``; returns them. Call it only while no rank saves (``load`` calls it once every
    rank has finished its saves in flight). A folder whose manifest names missing or resized
    files is damaged, not partial: it is left for a person."""
    removed = []
    for _, folder in _step_folders(root):
        if folder != keep and not (folder / MANIFEST).exists():
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def prune(root: Path, keep_last: int) -> None:
    """Remove all but the newest ``keep_last`` complete checkpoints (the manifest first, so a
    half-removed folder is never taken for a checkpoint)."""
    complete = [f for _, f in _step_folders(root) if read_manifest(f) is not None]
    for folder in complete[keep_last:]:
        (folder / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(folder, ignore_errors=True)


def save_file(path: Path, payload: Any) -> int:
    """``torch.save(payload)`` to ``path`` atomically; returns its size."""
    return write_atomically(path, lambda f: torch.save(payload, f))

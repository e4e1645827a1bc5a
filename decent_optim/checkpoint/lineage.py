"""Which trajectory wrote a rank file, so that saving a step again never mixes two trajectories.

A *lineage* is a stretch of training that only goes forward. It begins where ``load`` resumes
(rank 0 draws a random name and every rank takes it from load's all-gather) or, in a process
that never loaded from the folder, at the launch (torchrun's run id, the same on every node;
empty without torchrun). Every rank file carries its lineage in its header (``"save"``), and the
manifest names it.

Saving a step whose committed manifest names another lineage -- after ``load(step=2)`` went
back, step 4 of the abandoned trajectory is still committed when step 4 is saved again -- first
un-commits it: each rank removes the manifest and syncs the folder before writing its own file,
so from the first new file on the folder is no checkpoint, and a save that dies half way leaves
the earlier complete checkpoints as the newest (``load`` then removes what is left of it). The
other ranks' old files are there from the start, of the same size: rank 0 commits only once
every rank's file carries the new lineage (:func:`written_by`).

Within one lineage, a step saved twice belongs to one trajectory (e.g. the periodic save of
the last step and a final save of it): the files are replaced in place and the commit stays.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from decent_optim.checkpoint.directory import HEADER, MANIFEST, sync_folder

__all__ = ["begin", "current", "draw", "uncommit_other", "written_by"]

#: per root folder, the lineage this process saves under (set by ``load``)
_LINEAGES: dict[Path, str] = {}


def draw() -> str:
    """A new lineage's name (rank 0 draws it in ``load``)."""
    return os.urandom(8).hex()


def begin(root: Path, name: str) -> None:
    """From now on this process saves into ``root`` under lineage ``name``."""
    _LINEAGES[root] = name


def current(root: Path) -> str:
    """The lineage of this process's saves into ``root`` (the same on every rank)."""
    # not the restart count: each node's agent keeps its own
    launch = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return _LINEAGES.get(root, f"launch {launch}" if launch else "")


def uncommit_other(folder: Path, name: str) -> None:
    """Remove ``folder``'s manifest if it names another lineage than ``name`` (module
    docstring); called by every rank before it writes its file."""
    path = folder / MANIFEST
    try:
        committed = json.loads(path.read_text()).get("save", "")
    except FileNotFoundError:
        return
    except (OSError, ValueError, AttributeError):
        committed = None  # unreadable: not ours to keep
    if committed == name:
        return
    path.unlink(missing_ok=True)
    sync_folder(folder)  # the removal reaches the disk before the new file does


def written_by(name: str, read: Callable[[Path], Any]) -> Callable[[Path], bool]:
    """Whether a rank file's header names lineage ``name``; ``read`` reads it (memory-mapped).
    Each version of a file (it is replaced atomically: a new inode) is read once."""
    seen: dict[Path, tuple[tuple[int, int, int], bool]] = {}

    def check(path: Path) -> bool:
        try:
            info = path.stat()
            version = (info.st_ino, info.st_mtime_ns, info.st_size)
            if path in seen and seen[path][0] == version:
                return seen[path][1]
            header = read(path).get(HEADER)
            ours = isinstance(header, dict) and header.get("save", "") == name
        except Exception:  # replaced while read, or not a checkpoint: look again later
            return False
        seen[path] = (version, ours)
        return ours

    return check

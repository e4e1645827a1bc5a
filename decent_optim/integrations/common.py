"""What the framework adapters share: our optimizer behind a wrapper, and each rank's own file.

Frameworks save the model and the optimizer from rank 0 only, because under DDP every rank holds
the same values. In decentralized training each rank's parameters and optimizer state are its
own: a resume that restores rank 0's on every rank restarts the ranks from one point, with round
counters and rounds in flight that no longer belong to the weights, and the run silently leaves
the uninterrupted trajectory. So each adapter also writes one file per rank, named by
:func:`rank_path`, holding that rank's model and optimizer state, and reads it back on the same
rank; the framework's own files keep what is the same on every rank (schedulers, trainer state)
and the consensus model (:func:`consensus`), for export.

Resuming at another world size: when this rank's file is not there but the complete set of
another world size is, each rank starts from the mean of the saved copies
(:mod:`decent_optim.checkpoint.resize`, read one file at a time), with the round counter kept
(:func:`read_own_or_resized`).

Nothing here imports a framework.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from decent_optim import wrappers
from decent_optim.checkpoint import resize
from decent_optim.optim.checkpoint import KEY
from decent_optim.optim.engine import DecentralizedOptimizer

__all__ = [
    "consensus",
    "decentralized",
    "load_models_and_optimizers",
    "load_rank_file",
    "on_device",
    "rank_path",
    "read_own_or_resized",
    "save_models_and_optimizers",
    "save_rank_file",
    "unwrap",
]

Prefix = str | os.PathLike[str]  # a rank file's path up to ``rank{r}-of-{n}.pt``
Modules = Sequence[torch.nn.Module]
Optimizers = Sequence[DecentralizedOptimizer]


def unwrap(optimizer: object) -> DecentralizedOptimizer | None:
    """The decentralized optimizer inside ``optimizer`` and its wrappers, or None.

    :func:`decent_optim.unwrap`, with None for an optimizer that is not a decent_optim one.
    """
    try:
        return wrappers.unwrap(optimizer)
    except TypeError:
        return None


def decentralized(optimizers: Iterable[object]) -> list[DecentralizedOptimizer]:
    """The decentralized optimizers among ``optimizers`` (unwrapped), in order."""
    found = [unwrap(o) for o in optimizers]
    return [o for o in found if o is not None]


@contextlib.contextmanager
def consensus(
    optimizers: Sequence[DecentralizedOptimizer], module: torch.nn.Module | None
) -> Iterator[None]:
    """Within the block ``module`` holds the consensus model (see ``averaged()``); a collective.

    Every optimizer averages its own parameters; ``module``'s floating-point buffers are
    averaged once. Without optimizers (before training) nothing changes.
    """
    with contextlib.ExitStack() as stack:
        for k, opt in enumerate(optimizers):
            stack.enter_context(opt.averaged(module if k == 0 else None))
        yield


def on_device(module: torch.nn.Module, device: torch.device | str) -> bool:
    """True when every parameter and buffer of ``module`` is on ``device`` already.

    ``cpu`` and ``cpu:0`` are one device, as are ``cuda:k`` and ``cuda`` while ``k`` is the
    current one; ``module.to(device)`` would still copy every tensor, and a decentralized
    optimizer's parameters must stay views of its buffers, so the adapters skip that move.
    """
    target = torch.device(device)
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    for t in [*module.parameters(), *module.buffers()]:
        if t.device.type != target.type:
            return False
        if target.type != "cpu" and t.device.index != target.index:
            return False
    return True


def rank_path(prefix: str | os.PathLike[str], rank: int, world_size: int) -> Path:
    """``{prefix}rank{r}-of-{n}.pt``: the file of rank ``r`` of ``n``."""
    return Path(f"{os.fspath(prefix)}rank{rank}-of-{world_size}.pt")


def save_rank_file(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` atomically (a crash mid-write leaves the old file or none)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save(payload, partial)
    os.replace(partial, path)


def load_rank_file(path: Path) -> dict[str, Any]:
    """Read a file written by :func:`save_rank_file`; a missing one is a clear error."""
    if not path.is_file():
        siblings = sorted(p.name for p in path.parent.glob("*rank*-of-*.pt"))
        found = f"; the folder holds {', '.join(siblings)}" if siblings else ""
        raise FileNotFoundError(
            f"{path} not found: a decentralized checkpoint has one file per rank, and this rank's "
            f"is missing{found}, and no complete set of another world size is there to resume "
            "from. Let every rank save (the adapters do; a save on rank 0 only does not)"
        )
    loaded: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return loaded


def saved_set(prefix: Prefix) -> list[Path] | None:
    """The files ``{prefix}rank{r}-of-{n}.pt`` of the one ``n`` whose ranks 0..n-1 are all
    there, by rank; None when there is none. Two complete sets of different sizes raise."""
    folder, name = Path(prefix).parent, Path(prefix).name
    pattern = re.compile(re.escape(name) + r"rank(\d+)-of-(\d+)\.pt$")
    by_size: dict[int, set[int]] = {}
    for path in folder.glob(f"{glob_escape(name)}rank*-of-*.pt"):
        match = pattern.fullmatch(path.name)
        if match:
            by_size.setdefault(int(match.group(2)), set()).add(int(match.group(1)))
    complete = [n for n, ranks in by_size.items() if ranks == set(range(n))]
    if len(complete) > 1:
        raise ValueError(
            f"{folder} holds complete checkpoints of {sorted(complete)} ranks under "
            f"{name!r}: remove the ones that do not belong to this checkpoint"
        )
    return [rank_path(prefix, r, complete[0]) for r in range(complete[0])] if complete else None


def glob_escape(text: str) -> str:
    return re.sub(r"([*?[])", r"[\1]", text)


def read_own_or_resized(prefix: Prefix, rank: int, world_size: int) -> tuple[dict[str, Any], bool]:
    """This rank's file, or (when only another world size's files are there) what this rank
    starts from by the ``"consensus"`` rule, with the optimizer states made loadable; returns
    it and whether it was resized."""
    own = rank_path(prefix, rank, world_size)
    paths = None if own.is_file() else saved_set(prefix)
    if paths is None:
        return load_rank_file(own), False
    files = paths

    def check(old_rank: int, contents: Any) -> None:
        for state in _optimizer_states(contents):
            entry = state.get(KEY, {})
            if (entry.get("rank", old_rank), entry.get("world_size", len(files))) != (
                old_rank,
                len(files),
            ):
                raise ValueError(
                    f"{files[old_rank]} holds the optimizer state of rank {entry.get('rank')} of "
                    f"{entry.get('world_size')}, not of rank {old_rank} of {len(files)}: the "
                    "files were renamed or mixed"
                )

    return resize.retarget(resize.merged(paths, rank, check=check)), True


def _optimizer_states(contents: Any) -> list[dict[str, Any]]:
    if not isinstance(contents, dict):
        return []
    states = contents.get("optimizers", contents.get("optimizer_states"))
    return [s for s in states if isinstance(s, dict)] if isinstance(states, list) else []


def save_models_and_optimizers(prefix: Prefix, models: Modules, optimizers: Optimizers) -> Path:
    """Write this rank's ``models`` and ``optimizers`` state to its :func:`rank_path`."""
    path = rank_path(prefix, optimizers[0].rank, optimizers[0].world_size)
    payload = {
        "models": [m.state_dict() for m in models],
        "optimizers": [o.state_dict() for o in optimizers],
    }
    save_rank_file(path, payload)
    return path


def load_models_and_optimizers(prefix: Prefix, models: Modules, optimizers: Optimizers) -> None:
    """Load what :func:`save_models_and_optimizers` wrote for this rank, in place."""
    payload, _ = read_own_or_resized(prefix, optimizers[0].rank, optimizers[0].world_size)
    saved = (len(payload["models"]), len(payload["optimizers"]))
    if saved != (len(models), len(optimizers)):
        raise ValueError(
            f"the checkpoint holds {saved[0]} model(s) and {saved[1]} decentralized optimizer(s), "
            f"but {len(models)} and {len(optimizers)} are being resumed; build the same ones"
        )
    for model, state in zip(models, payload["models"]):
        model.load_state_dict(state)
    for opt, state in zip(optimizers, payload["optimizers"]):
        opt.load_state_dict(state)

"""What ``save`` and ``load`` refuse before they write, delete or exchange anything.

Each check raises on the rank that calls it with the cause and the fix; every rank runs the
same checks on arguments of the same kind, so a refusal comes from every rank at once, before
any rank waits for another.

* ``keep_last``: None or a whole number >= 1 (0 would prune the checkpoint just written).
* Sharded parameters (DTensors, e.g. FSDP2's ``fully_shard``): this package's checkpoints hold a
  whole copy of the model per gossip rank, and a rank of a sharded replica holds a shard; such
  models are saved per replica with ``torch.distributed.checkpoint`` (docs: large_models).
* Inside ``opt.averaged()``: the parameters are the mean over the ranks there, not the rank's
  own; a save would resume every rank from the mean, and a load would be undone at the block's
  exit.
* A path that is not the checkpoint folder (a file, or one step folder in it): ``load`` would
  find no checkpoint there and start from scratch without a word.
* ``extra``: it must load back under the rules ``load`` reads with (``torch.load`` with
  ``weights_only=True``), checked by that very round trip in memory at save time (with its
  plain tensors emptied: the types matter, not the data) -- a value it refuses would make every
  checkpoint of the run unloadable, found out only at the resume.
"""

from __future__ import annotations

import io
import numbers
import re
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from decent_optim import sharded

__all__ = [
    "check_extra",
    "check_keep_last",
    "check_step",
    "refuse_inside_averaged",
    "refuse_not_a_root",
    "refuse_sharded",
]


def check_keep_last(keep_last: object) -> None:
    """``keep_last`` is None or a whole number >= 1."""
    if keep_last is None:
        return
    if isinstance(keep_last, bool) or not isinstance(keep_last, numbers.Integral):
        raise TypeError(
            f"keep_last must be None (keep every checkpoint) or a whole number >= 1, got "
            f"{keep_last!r} of type {type(keep_last).__name__}; nothing was written or removed"
        )
    if keep_last < 1:
        raise ValueError(
            f"keep_last={keep_last} would remove every checkpoint, the one being saved "
            "included: pass a whole number >= 1 (the newest checkpoints kept), or None to keep "
            "them all; nothing was written or removed"
        )


def check_step(step: object, name: str = "step") -> None:
    """``step`` is a whole number >= 0."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"{name} must be a whole number >= 0, got {step!r}")


def refuse_inside_averaged(call: str, opt: Any) -> None:
    """Raise when ``opt.averaged()`` holds the parameters (every rank is inside it: a
    collective)."""
    block = opt._rounds.held_by
    if block is None:
        return
    if call == "save":
        harm = "a checkpoint of them would resume every rank from the mean, losing its own copy"
        more = (
            " To save the averaged model for export, call sd = opt.consensus_state_dict(model) "
            "outside the block and torch.save(sd, ...) on rank 0. Nothing was written"
        )
    else:
        harm = "the block puts them back on exit, which would undo the load"
        more = " Nothing was read or changed"
    raise RuntimeError(
        f"decent_optim.checkpoint.{call} inside {block}: within the block every rank's "
        f"parameters are the mean over all ranks, not its own, and {harm}. Call "
        f"decent_optim.checkpoint.{call}(...) after the block.{more}"
    )


_STEP_FOLDER = re.compile(r"^step-(\d+)$")
#: what a checkpoint folder is, for the refusals of paths that are not one
_WHAT_SAVE_WRITES = (
    "decent_optim.checkpoint.save(root, ...) writes a checkpoint folder: root holds a folder per "
    "saved step (step-00000100/, ...), each with a file per rank (rank-00000-of-00004.pt, ...) "
    "and a manifest.json; load() takes that root, the same folder given to save"
)


def _written_by_torch_save(path: Path) -> bool:
    """Whether ``path`` looks like a ``torch.save`` file (its zip format or the legacy one)."""
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                return any(n.rsplit("/", 1)[-1] == "data.pkl" for n in archive.namelist())
        with open(path, "rb") as f:  # the legacy format: torch's magic number, pickled first
            return f.read(14) == b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19"
    except OSError:
        return False


def refuse_not_a_root(root: Path) -> None:
    """Raise when ``root`` (resolved), given to ``load``, is a file or one step folder: there
    would be no checkpoint to find, and the run would start from scratch without a word."""
    if not root.exists():
        return  # no checkpoint yet: the first run
    step = _STEP_FOLDER.match(root.parent.name if root.is_file() else root.name)
    instead = ""
    if step is not None:  # a file of a step folder, or the step folder itself
        top = root.parent.parent if root.is_file() else root.parent
        instead = (
            f" It is part of the checkpoint of step {int(step.group(1))} in {top}: "
            f"decent_optim.checkpoint.load('{top}', model, opt, step={int(step.group(1))})."
        )
    elif root.is_file() and _written_by_torch_save(root):
        instead = (
            f" {root} looks written by torch.save: read it with "
            f"state = torch.load('{root}', map_location='cpu', weights_only=True) and give its "
            "parts to model.load_state_dict(...) and opt.load_state_dict(...) (a torch.optim "
            "state dict loads too; docs: migrating_from_ddp)."
        )
    if root.is_file():
        raise NotADirectoryError(
            f"decent_optim.checkpoint.load: {root} is a file, not a checkpoint folder. "
            f"{_WHAT_SAVE_WRITES}.{instead} Nothing was read or changed"
        )
    if step is not None:
        raise ValueError(
            f"decent_optim.checkpoint.load: {root} is one step's folder, not a checkpoint "
            f"folder. {_WHAT_SAVE_WRITES}.{instead} Nothing was read or changed"
        )


#: the supported route for sharded models, for the refusal's message
DCP_ROUTE = (
    "Save each replica with torch.distributed.checkpoint over the ranks of its shards: "
    "model_sd, optim_sd = get_state_dict(model, opt); "
    'dcp.save({"model": model_sd, "optim": optim_sd}, '
    "checkpoint_id=f\"ckpt/replica{mesh['replicate'].get_local_rank()}\", "
    'process_group=mesh["shard"].get_group()), and resume with dcp.load(...) on the same '
    'state, then set_state_dict(model, opt, ...) (docs: large_models, "Checkpoints"); with '
    "Lightning, decent_optim.integrations.lightning.DecentralizedModelParallelStrategy does it"
)


def refuse_sharded(call: str, tensors: Iterable[Any]) -> None:
    """Raise when any of ``tensors`` (the model's and the optimizer's parameters) is sharded."""
    found = next((t for t in tensors if sharded.is_sharded(t)), None)
    if found is None:
        return
    raise TypeError(
        f"decent_optim.checkpoint.{call} does not support sharded parameters (a DTensor of "
        f"shape {tuple(found.shape)}, e.g. from FSDP2's fully_shard): its checkpoints hold a "
        "whole copy of the model per gossip rank, but each rank of a sharded replica holds "
        f"only a shard. Nothing was {'written' if call == 'save' else 'read or changed'}. "
        + DCP_ROUTE
    )


def _skeleton(value: Any) -> Any:
    """``value`` with every plain dense tensor in its dicts, lists and tuples made empty: the
    unpickler sees the same types, and the round trip costs no copy of the data."""
    if type(value) is torch.Tensor and value.layout == torch.strided and not value.is_quantized:
        return torch.empty(0, dtype=value.dtype)
    if type(value) is dict:
        return {k: _skeleton(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_skeleton(v) for v in value)
    return value  # anything else as it is (a subclass must round-trip as itself)


def _loads_back(value: Any) -> bool:
    """Whether ``value`` survives ``torch.save`` and ``torch.load(weights_only=True)``."""
    buffer = io.BytesIO()
    try:
        torch.save(_skeleton(value), buffer)
        buffer.seek(0)
        torch.load(buffer, map_location="cpu", weights_only=True)
    except Exception:
        return False
    return True


def _parts(value: Any) -> list[tuple[str, Any]]:
    """``(where, part)`` of a container's keys and items; empty for anything else."""
    if isinstance(value, dict):
        keys = [(f" (the key {k!r})", k) for k in value]
        return keys + [(f"[{k!r}]", v) for k, v in value.items()]
    if isinstance(value, (list, tuple)):
        return [(f"[{k}]", v) for k, v in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        return [(f" (an element {v!r})", v) for v in value]
    return []


def _refused(value: Any, where: str) -> tuple[str, Any]:
    """The innermost part of ``value`` (refused as a whole) that is refused."""
    for step, part in _parts(value):
        if not _loads_back(part):
            return _refused(part, where + step)
    return where, value  # its parts load back: its own type is refused


def _fix(refused: Any) -> str:
    kind = type(refused)
    if kind.__module__.split(".")[0] == "numpy":
        return (
            "Store numpy values as plain Python or torch values: array.tolist() or "
            "torch.from_numpy(array), int(x) / float(x) for numpy scalars; numpy's random state "
            "as s = np.random.get_state(); (s[0], s[1].tolist(), *s[2:]), which "
            "np.random.set_state accepts back as it is (a Generator's rng.bit_generator.state "
            "is plain already)"
        )
    return (
        "Store it as tensors, numbers, strings, lists, tuples and dicts (e.g. the object's "
        "state_dict() or a dict of its fields), or register its class with "
        "torch.serialization.add_safe_globals([...]) in the process that saves and in the one "
        "that loads"
    )


def check_extra(extra: Any) -> None:
    """Raise when ``extra`` would not load back (module docstring), naming where and what."""
    if extra is None or _loads_back(extra):
        return
    where, refused = _refused(extra, "extra")
    kind = type(refused)
    raise TypeError(
        f"decent_optim.checkpoint.save(extra=...) would write a checkpoint that load() "
        f"refuses: {where} is a {kind.__module__}.{kind.__qualname__}, which torch.load("
        "weights_only=True) (what load reads with) does not accept, so every checkpoint of "
        f"the run would be unloadable. {_fix(refused)}. Nothing was written"
    )

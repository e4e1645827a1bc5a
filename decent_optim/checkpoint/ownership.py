"""One model and optimizer per checkpoint folder: two sharing one must never mix their files.

Two optimizers saving into one folder (a GAN's generator and discriminator) write the same file
names at the same step; the second would overwrite the first, and ``load`` would give one model
the other's weights. Three checks keep them apart:

* in this process, a folder belongs to the optimizer that last saved into it or loaded from
  it, while that optimizer lives (a weak reference); a save into it by another optimizer is
  refused -- this catches models of the same architecture too;
* across processes, a save over an existing file of the same step and rank compares that file's
  optimizer class and model layout (parameter and buffer names and shapes) with its own;
* ``load`` compares the saved model's layout with the model it loads into, before anything
  changes, and names the first difference.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import torch

__all__ = ["check_layout", "layout", "own", "refuse_other_file", "refuse_other_owner"]

#: per root folder, (the optimizer that owns it in this process, the step it last saved there)
_OWNERS: dict[Path, tuple[weakref.ref[Any], int | None]] = {}

_SEPARATE = (
    "Save each model and optimizer into a folder of its own, e.g. "
    'checkpoint.save("ckpt/G", G, opt_G, ...) and checkpoint.save("ckpt/D", D, opt_D, ...)'
)


def _describe(opt: Any) -> str:
    count = sum(len(g["params"]) for g in opt.param_groups)
    return f"a {type(opt).__name__} of {count} parameter tensor(s)"


def _owner(root: Path) -> tuple[Any, int | None]:
    held = _OWNERS.get(root)
    return (None, None) if held is None else (held[0](), held[1])


def refuse_other_owner(root: Path, opt: Any) -> None:
    """Raise when another living optimizer of this process owns ``root`` (module docstring)."""
    owner, last = _owner(root)
    if owner is None or owner is opt:
        return
    when = f"saved step {last} there" if last is not None else "loaded from there"
    raise ValueError(
        f"decent_optim.checkpoint.save into {root}: another optimizer of this process "
        f"({_describe(owner)}, which {when}) owns that folder, and this one is "
        f"{_describe(opt)}. Two models or optimizers saving into one folder overwrite each "
        f"other's files, and load() would give one the other's weights. {_SEPARATE}. If the "
        "other optimizer is no longer used, delete it (del opt), or load() into this one "
        "first. Nothing was written"
    )


def own(root: Path, opt: Any, step: int | None) -> None:
    """Make ``opt`` the owner of ``root`` in this process (``step``: the one it saves, or None
    for a load)."""
    _OWNERS[root] = (weakref.ref(opt), step)


def layout(state: dict[str, Any]) -> dict[str, tuple[int, ...] | None]:
    """Name -> shape of every tensor of a model's state dict (None for a non-tensor entry)."""
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in state.items()}


def _first_difference(saved: dict[str, Any], mine: dict[str, Any]) -> str | None:
    for name in sorted(set(saved) | set(mine)):
        if name not in mine:
            return f"{name!r} is in the saved model only"
        if name not in saved:
            return f"{name!r} is in this model only"
        if saved[name] != mine[name]:
            return f"{name!r} has shape {saved[name]} saved and {mine[name]} here"
    return None


def check_layout(saved: Any, model: torch.nn.Module, where: str) -> None:
    """Raise when the saved model state ``saved`` is not of ``model``'s layout."""
    if not isinstance(saved, dict):
        raise ValueError(f"{where} holds no model state dict: it is not a checkpoint of ours")
    difference = _first_difference(layout(saved), layout(model.state_dict()))
    if difference is not None:
        raise ValueError(
            f"{where} was saved from another model ({difference}); nothing was loaded. Load "
            "it into the model it was saved from, or point load() at this model's own "
            f"folder. {_SEPARATE}"
        )


def refuse_other_file(path: Path, model: torch.nn.Module, opt: Any, read: Any) -> None:
    """Raise when ``path`` (this rank's file of the step being saved) exists and belongs to
    another optimizer class or model layout; ``read`` reads it (memory-mapped)."""
    if not path.is_file():
        return
    try:
        contents = read(path)
        header, saved = contents["decent_optim_checkpoint"], contents["model"]
        theirs = header["optimizer_class"]
    except Exception:  # unreadable or not ours: replacing it loses nothing loadable
        return
    difference = _first_difference(layout(saved), layout(model.state_dict()))
    if theirs != type(opt).__name__:
        difference = f"it was saved by {theirs}, this optimizer is {type(opt).__name__}"
    if difference is not None:
        raise ValueError(
            f"decent_optim.checkpoint.save: {path} already holds the checkpoint of another "
            f"model or optimizer at this step ({difference}); saving would overwrite it. "
            f"{_SEPARATE}. Nothing was written"
        )

r"""Resuming at another world size: what each of the M new ranks starts from, given N saved copies.

A decentralized run saves one copy of the model and the optimizer state per rank. Resuming with
the same N ranks loads each rank's own file (bit for bit the uninterrupted run). With M != N the
ranks cannot keep their old copies one to one, so new rank :math:`r` starts from

* ``"consensus"`` (the default): the mean of the N saved copies, for the parameters and for every
  floating-point state tensor alike (momentum, Adam's moments, floating-point model buffers),

  .. math:: x_r = \frac{1}{N} \sum_{k=0}^{N-1} x_k ,

  and the largest of the saved step counts (the counts are equal unless a parameter missed
  gradients on some rank). The mean is what gossip keeps (every round's mixing matrix is doubly
  stochastic), so it is the point the old run was contracting to; it is also the model the run
  evaluates. Every new rank starts from the same values, as after the start-up broadcast.
* ``"rank"``: old rank :math:`r \bmod N`'s copy, unchanged -- each surviving rank keeps its own,
  and new ranks beyond N repeat the old copies in turn.

Everything else (integers, strings, hyper-parameters, integer tensors such as random-generator
states) is taken from old rank 0's file under ``"consensus"`` and from the chosen file under
``"rank"``. Files are read one at a time, memory-mapped, and added into one accumulator, so no
rank ever holds more than one saved copy plus the running sum (never all N).

The optimizer's own ``"decent_optim"`` entry is then rewritten for the new world
(:func:`retarget`): same round counter, no round in flight (a round of the old topology cannot run
on the new one; under ``"consensus"`` its mix is already in the mean, since mixing keeps the
mean), and without the old world's size, rank and topology, which ``load_state_dict`` would
otherwise refuse. The first rounds after the load send exact
values, so ``compression=``'s public copies are rebuilt from the loaded parameters: the saved
copies belong to the old world's groups and are neither merged nor kept. With ``uneven=True``
the saved schedule keeps the old world size, so that the DDP-equivalent progress carries over
(:meth:`~decent_optim.optim.uneven.UnevenPeriods.load`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from decent_optim.optim.checkpoint import COPIES, KEY
from decent_optim.optim.local_checkpoint import ENTRY

__all__ = ["RULES", "merged", "read", "retarget", "source_of"]

#: the rules for what a new rank starts from (module docstring)
RULES = ("consensus", "rank")

Path = str | os.PathLike[str]


def read(path: Path) -> Any:
    """A saved file, memory-mapped on the CPU: its tensors are read from disk when touched."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def source_of(rank: int, old_world_size: int) -> int:
    """The old rank whose copy new rank ``rank`` starts from under the ``"rank"`` rule."""
    return rank % old_world_size


def merged(
    paths: Sequence[Path],
    rank: int,
    rule: str = "consensus",
    *,
    check: Callable[[int, Any], None] | None = None,
    load: Callable[[Path], Any] = read,
) -> Any:
    """What new rank ``rank`` starts from, given the old ranks' files ``paths`` (index = old rank).

    Args:
        paths: one file per old rank, each holding nested dicts/lists of tensors and plain values.
        rank: the new rank.
        rule: ``"consensus"`` or ``"rank"`` (module docstring).
        check: called as ``check(old_rank, contents)`` on every file read, before it is used
            (to refuse files of another run or step); raises to refuse.
        load: reads a file (default :func:`read`).
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if not paths:
        raise ValueError("resuming needs the saved files of at least one rank, got none")
    if rule == "rank":
        source = source_of(rank, len(paths))
        contents = load(paths[source])
        if check is not None:
            check(source, contents)
        return contents
    total: Any = None
    for old_rank, path in enumerate(paths):
        contents = load(path)
        if check is not None:
            check(old_rank, contents)
        contents = _without_copies(contents)  # each rank's own, of shapes of its own
        total = _add(total, contents, f"file of rank {old_rank}", "")
        del contents  # unmapped before the next file is read
    return _mean(total, len(paths))


class _Sum:
    """A running sum of one floating-point tensor (or the running maximum of a step count)."""

    def __init__(self, value: Tensor, is_step: bool) -> None:
        self.dtype, self.is_step = value.dtype, is_step
        # float32 at least: the mean of a few bf16 copies would round at every addition
        wide = torch.promote_types(value.dtype, torch.float32)
        self.total = value.detach().to(dtype=wide, copy=True)

    def add(self, value: Tensor, where: str) -> None:
        if value.shape != self.total.shape:
            raise ValueError(
                f"{where} has shape {tuple(value.shape)} in one file and "
                f"{tuple(self.total.shape)} in another: the files are not copies of one model"
            )
        if self.is_step:
            torch.maximum(self.total, value.to(self.total.dtype), out=self.total)
        else:
            self.total.add_(value.to(self.total.dtype))

    def result(self, count: int) -> Tensor:
        return (self.total if self.is_step else self.total / count).to(self.dtype)


def _add(total: Any, value: Any, where: str, key: Any) -> Any:
    """``total`` with ``value`` added, walking dicts and lists alike in both."""
    if isinstance(value, Tensor) and value.is_floating_point():
        if total is None:
            return _Sum(value, key == "step")
        if not isinstance(total, _Sum):
            raise ValueError(f"{where}: {key!r} is a tensor in one file and not in another")
        total.add(value, f"{where}: {key!r}")
        return total
    if isinstance(value, dict):
        if total is None:
            total = {k: None for k in value}
        if not isinstance(total, dict) or set(total) != set(value):
            raise ValueError(
                f"{where}: {key or 'the top level'!r} holds other keys than in the file of rank 0 "
                "(another model or optimizer): every file must come from the same run"
            )
        return {k: _add(total[k], v, where, k) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if total is None:
            total = [None] * len(value)
        if not isinstance(total, list) or len(total) != len(value):
            raise ValueError(f"{where}: {key!r} has another length than in the file of rank 0")
        return [_add(t, v, where, key) for t, v in zip(total, value)]
    return value if total is None else total  # plain values: old rank 0's


def _mean(total: Any, count: int) -> Any:
    if isinstance(total, _Sum):
        return total.result(count)
    if isinstance(total, dict):
        return {k: _mean(v, count) for k, v in total.items()}
    if isinstance(total, list):
        return [_mean(v, count) for v in total]
    return total


def _without_copies(tree: Any) -> Any:
    """``tree`` without compressed gossip's public copies in any optimizer state dict."""
    if isinstance(tree, dict):
        out = {k: _without_copies(v) for k, v in tree.items()}
        entry = out.get(KEY)
        if isinstance(entry, dict) and COPIES in entry:
            out[KEY] = {k: v for k, v in entry.items() if k != COPIES}
        return out
    if isinstance(tree, list):
        return [_without_copies(v) for v in tree]
    return tree


def retarget(tree: Any) -> Any:
    """``tree`` with every optimizer state dict in it made loadable at another world size.

    In each dict holding a ``"decent_optim"`` entry, the entry keeps the round counter, says no
    round is in flight, and loses what ties it to the saving world (world size, rank, topology,
    the fingerprint of that rank's parameters, the public copies of compressed gossip), which
    ``load_state_dict`` then does not check.
    """
    if isinstance(tree, dict):
        out = {k: retarget(v) for k, v in tree.items()}
        entry = out.get(KEY)
        if isinstance(entry, dict):
            kept = {k: v for k, v in entry.items() if k not in _OWNER_KEYS}
            local = kept.get(ENTRY)
            if isinstance(local, dict) and isinstance(local.get("uneven"), dict):
                # the saving world's size, which the progress is measured in (files of older
                # versions lack it in the schedule)
                uneven = {"world_size": entry.get("world_size"), **local["uneven"]}
                kept[ENTRY] = {**local, "uneven": uneven}
            out[KEY] = {**kept, "pending": False}
        return out
    if isinstance(tree, list):
        return [retarget(v) for v in tree]
    return tree


#: what ties a saved optimizer state to the world that saved it (a sharded optimizer's copy in
#: ``param_groups[0]`` names its replica)
_OWNER_KEYS = ("world_size", "rank", "replica", "topology", "params", COPIES)

"""The consensus model: the mean of every rank's parameters, for evaluation and export.

Both are collectives over the optimizer's process group. They first complete the transfers of the
round in flight (its sends read the buffers) without mixing it: the next step still mixes it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from decent_optim.optim.rounds import Rounds

__all__ = ["averaged", "distance"]


@contextlib.contextmanager
def averaged(
    rounds: Rounds,
    buffers: list[Tensor],
    module: torch.nn.Module | None,
    publish: Callable[[], None] = lambda: None,
) -> Iterator[None]:
    """Replace ``buffers`` (and ``module``'s float buffers) by their mean; restore them on exit.

    ``publish`` copies the buffers where the model reads them (sharded parameters)."""
    rounds.check_free("opt.averaged()")
    rounds.wait()
    tensors = list(buffers)
    if module is not None:
        tensors += [b for b in module.buffers() if b.is_floating_point()]
    backup = [t.detach().clone() for t in tensors]
    rounds.held_by = "opt.averaged()"
    try:
        with torch.no_grad():
            rounds.gossip.average_([t.detach() for t in tensors], "opt.averaged()")
        publish()
        yield
    finally:
        rounds.held_by = None
        with torch.no_grad():
            for t, saved in zip(tensors, backup):
                t.copy_(saved)
        publish()
        rounds.record_versions()  # what the block wrote is undone: nothing raced


def distance(
    rounds: Rounds, buffers: list[Tensor], total: Callable[[float], float] = lambda x: x
) -> float:
    """This rank's 2-norm distance to the mean of ``buffers`` over the ranks, in float64.

    ``total`` sums the squared distance over the ranks holding one model together (shards)."""
    rounds.wait()
    values = [b.double() for b in buffers]  # float64 copies: an exact-ish mean
    mean = [v.clone() for v in values]
    rounds.gossip.average_(mean, "opt.consensus_distance()")
    return math.sqrt(
        total(sum(float(torch.sub(v, m).square().sum()) for v, m in zip(values, mean)))
    )

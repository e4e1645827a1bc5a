"""The consensus model: the mean of every rank's parameters, for evaluation and export.

:class:`ConsensusViews` gives the optimizers ``averaged()``, ``consensus_distance()`` and
``consensus_state_dict()`` from :func:`averaged` and :func:`distance`. All are collectives over
the optimizer's process group. They first complete the transfers of the
round in flight (its sends read the buffers) without mixing it: the next step still mixes it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from decent_optim import sharded
from decent_optim.flat import FlatParams
from decent_optim.optim.failure import FailureLatch, guarded, guarded_block
from decent_optim.optim.rounds import Rounds

__all__ = ["ConsensusViews", "averaged", "distance"]


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
    rounds.check_round("opt.averaged()")
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
    rounds.check_round("opt.consensus_distance()")
    rounds.wait()
    values = [b.double() for b in buffers]  # float64 copies: an exact-ish mean
    mean = [v.clone() for v in values]
    rounds.gossip.average_(mean, "opt.consensus_distance()")
    return math.sqrt(
        total(sum(float(torch.sub(v, m).square().sum()) for v, m in zip(values, mean)))
    )


class ConsensusViews:
    """The consensus model's methods of every optimizer (a mixin of the engine, whose rounds,
    buffers and failure latch they use)."""

    _rounds: Rounds
    _flat: FlatParams
    _latch: FailureLatch

    _readopt: Callable[[], None]  # the engine's: take back moved parameters first

    def averaged(
        self, module: torch.nn.Module | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Within the block, every rank's parameters are the global average; restored on exit.

        A collective: every rank enters it at the same point. The round in flight is waited
        for (its values are kept to be mixed by the next :meth:`step`), the parameters are
        replaced by their mean over all ranks and, when ``module`` is given, so are its
        floating-point buffers (e.g. BatchNorm running statistics). On exit every value is
        restored bit for bit, so training continues as if the block never ran; :meth:`step`,
        :meth:`synchronize` and :meth:`load_state_dict` raise inside it, which would undo them.

        Example:
            >>> with opt.averaged(model):  # doctest: +SKIP
            ...     val_loss = evaluate(model)
        """
        with self._latch.guard():
            self._readopt()
        return guarded_block(
            self._latch,
            averaged(self._rounds, self._flat.buffers, module, self._flat.publish),
        )

    @guarded
    def consensus_distance(self) -> float:
        r"""This rank's distance to the mean parameters, :math:`\lVert x_i - \bar x \rVert_2`.

        A collective (every rank calls it; each gets its own distance), over every gossiped
        parameter, in float64; with sharded parameters, the distance of the rank's replica. Uses the current, unmixed values, like the paper's d2c.
        """
        self._readopt()
        params = [p for b in self._flat.buckets for p in b.params]
        return distance(self._rounds, self._flat.buffers, sharded.replica_sum(params))

    def consensus_state_dict(self, module: torch.nn.Module) -> dict[str, Tensor]:
        """``module.state_dict()`` of the globally averaged model, for export or deployment.

        A collective; every rank gets the same copy (save it from rank 0), of whole tensors
        (sharded parameters are gathered from their shards: it loads into any sharding and into
        a plain model). The rank's own
        values are untouched. Example: ``sd = opt.consensus_state_dict(model)``, then on rank 0
        ``torch.save(sd, "model.pt")``.
        """
        with self.averaged(module):
            return {k: sharded.full(v).detach().clone() for k, v in module.state_dict().items()}

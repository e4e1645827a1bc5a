"""``state_dict()`` and ``load_state_dict()`` of every optimizer.

torch.optim's format plus the package's entry (:mod:`~decent_optim.optim.checkpoint`: the round
counter and what the file belongs to), in which local steps keep their anchors, outer momentum
and slow weights (:mod:`~decent_optim.optim.local_checkpoint`).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from decent_optim.optim import checkpoint, local_checkpoint
from decent_optim.optim.failure import FailureLatch, guarded
from decent_optim.optim.rounds import Rounds

__all__ = ["StateDicts"]


class StateDicts:
    """The state-dict methods of every optimizer (a mixin of the engine)."""

    param_groups: list[dict[str, Any]]
    _rounds: Rounds
    _latch: FailureLatch

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's format plus a ``"decent_optim"`` entry: the round counter, whether a
        round is in flight, and what the file belongs to (world size, rank, topology, a
        fingerprint of the parameters); see :mod:`decent_optim.optim.checkpoint`.

        Does not wait for the round in flight: the first :meth:`step` after
        :meth:`load_state_dict` runs it again.
        """
        packed = checkpoint.save(self)  # type: ignore[arg-type]
        entry = local_checkpoint.save(self._rounds, self._params_in_order())
        if entry is not None:  # the anchors of local steps (mid-period resumes are exact)
            packed[checkpoint.KEY][local_checkpoint.ENTRY] = entry
        return packed

    @guarded
    def load_state_dict(self, state_dict: dict[str, Any], *, another_replica: bool = False) -> None:
        """Load torch.optim-format state; the round counter comes from the ``decent_optim`` entry.

        A collective: every rank loads its own file at the same point, and a file of another
        rank (replica), world size, topology or step raises the same error on every rank before
        anything changes; ``another_replica=True`` loads another rank's on purpose (e.g. every
        rank from one copy; see :mod:`~decent_optim.optim.ownership`). Without the entry (a
        torch.optim checkpoint) the counter is the largest per-parameter ``step``, or 0.
        Resuming works in both orders (model weights loaded before or after building the
        optimizer; see :class:`~decent_optim.optim.startup.Stash`).
        """
        extra = state_dict.get(checkpoint.KEY)
        entry = extra.get(local_checkpoint.ENTRY) if isinstance(extra, dict) else None
        # checks the entry with the rest, on every rank (local_checkpoint.check)
        checkpoint.load(self, state_dict, another_replica=another_replica)  # type: ignore[arg-type]
        local_checkpoint.restore(self._rounds, entry, self._params_in_order())

    def _params_in_order(self) -> list[Tensor]:
        """The parameters in torch.optim's state-dict order."""
        return [p for group in self.param_groups for p in group["params"]]

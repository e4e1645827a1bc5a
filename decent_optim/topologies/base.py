"""The :class:`Topology` base class: one round of a schedule in every form the package needs.

A subclass describes a round either as groups of uniform averaging or as a dense matrix; the
neighbour lists, weights, dense matrices and the mixing rate are derived here once, so every
topology answers the same questions the same way. Pure Python and torch, no communication.
"""

from __future__ import annotations

import numbers

import torch

__all__ = ["Groups", "Topology", "check_size", "is_power_of_two", "second_singular_value"]

#: a partition of the ranks into groups that average uniformly (singletons included)
Groups = list[tuple[int, ...]]


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return int(value)


class Topology:
    r"""A periodic schedule of doubly stochastic mixing matrices :math:`W^{(t)}`.

    Subclasses describe one round of the period, either as a partition of the ranks into groups
    that average uniformly (:meth:`_round_groups`) or, for arbitrary weights, as a dense matrix
    (:meth:`_round_matrix`). Everything else -- neighbour lists, weights, dense matrices, the
    mixing rate -- is derived here, so every topology answers the same questions the same way.

    Args:
        world_size: number of workers ``n``.
        local_world_size: workers per node; only node-aware topologies use it.
    """

    def __init__(self, world_size: int, local_world_size: int = 1) -> None:
        check_size("world_size", world_size)
        check_size("local_world_size", local_world_size)
        if world_size % local_world_size:
            raise ValueError(
                f"world_size ({world_size}) must be a multiple of local_world_size "
                f"({local_world_size}): every node runs the same number of workers"
            )
        self._world_size = world_size
        self._local_world_size = local_world_size
        self._cache: dict[int, _Round] = {}

    # -- what a subclass provides ---------------------------------------------------------------
    @property
    def period(self) -> int:
        """Number of distinct rounds; ``W(t) == W(t % period)``."""
        raise NotImplementedError

    def _round_groups(self, r: int) -> Groups | None:
        """Round ``r`` (``0 <= r < period``) as groups of uniform averaging, or ``None``."""
        return None

    def _round_matrix(self, r: int) -> torch.Tensor:
        """Round ``r`` as a dense float64 matrix; needed only when ``_round_groups`` is None."""
        raise NotImplementedError

    # -- public, derived ------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_world_size(self) -> int:
        return self._local_world_size

    def weights(self, rank: int, step: int) -> dict[int, float]:
        """Row ``rank`` of ``W(step)``: ``{source: weight}`` for every nonzero weight, self included."""
        return dict(self._round(step).rows[self._check_rank(rank)])

    def in_peers(self, rank: int, step: int) -> list[int]:
        """The other ranks whose values ``rank`` mixes in at round ``step``, ascending."""
        return list(self._round(step).in_peers[self._check_rank(rank)])

    def out_peers(self, rank: int, step: int) -> list[int]:
        """The other ranks that need ``rank``'s value at round ``step``, ascending."""
        return list(self._round(step).out_peers[self._check_rank(rank)])

    def groups(self, step: int) -> Groups | None:
        """The partition into uniformly averaging groups of round ``step``, or ``None``.

        Groups (singletons included) are ascending tuples, sorted by their first rank.
        ``None`` means the round has weights that no partition into group means expresses.
        """
        groups = self._round(step).groups
        return None if groups is None else list(groups)

    def mixing_matrix(self, step: int) -> torch.Tensor:
        """Dense ``W(step)`` in float64; for tests, docs and analysis, never on the hot path."""
        n = self._world_size
        dense = [[0.0] * n for _ in range(n)]
        for i, row in enumerate(self._round(step).rows):
            for j, weight in row.items():
                dense[i][j] = weight
        return torch.tensor(dense, dtype=torch.float64)

    def period_product(self) -> torch.Tensor:
        """``W(period-1) @ ... @ W(0)``: what one full period of gossip does to the stacked values."""
        prod = torch.eye(self._world_size, dtype=torch.float64)
        for r in range(self.period):
            prod = self.mixing_matrix(r) @ prod
        return prod

    def spectral_gap(self) -> float:
        """``1 - sigma_2`` of :meth:`period_product`; consensus error shrinks like ``sigma_2`` per period.

        ``sigma_2`` is the second largest singular value; since the product is doubly stochastic,
        it is the norm of the product restricted to deviations from the mean. 1.0 for one worker.
        """
        if self._world_size == 1:
            return 1.0
        return 1.0 - float(second_singular_value(self.period_product()))

    def __repr__(self) -> str:
        extra = f", local_world_size={self._local_world_size}" if self._local_world_size > 1 else ""
        return f"{type(self).__name__}(world_size={self._world_size}{extra})"

    # -- internals ------------------------------------------------------------------------------
    def _check_rank(self, rank: int) -> int:
        if not 0 <= rank < self._world_size:
            raise ValueError(f"rank must be in [0, {self._world_size}), got {rank}")
        return rank

    def _round(self, step: int) -> _Round:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        r = step % self.period
        cached = self._cache.get(r)
        if cached is None:
            groups = self._round_groups(r)
            if groups is not None:
                cached = _Round.from_groups(groups, self._world_size)
            else:
                cached = _Round.from_matrix(self._round_matrix(r))
            self._cache[r] = cached
        return cached


class _Round:
    """One round in the forms the gossip engine and the analysis need."""

    def __init__(self, rows: list[dict[int, float]], groups: Groups | None) -> None:
        n = len(rows)
        self.rows = rows
        self.groups = groups
        self.in_peers = [tuple(j for j in row if j != i) for i, row in enumerate(rows)]
        outs: list[list[int]] = [[] for _ in range(n)]
        for i, row in enumerate(rows):
            for j in row:
                if j != i:
                    outs[j].append(i)
        self.out_peers = [tuple(sorted(o)) for o in outs]

    @classmethod
    def from_groups(cls, groups: Groups, n: int) -> _Round:
        groups = sorted(tuple(sorted(g)) for g in groups)
        rows: list[dict[int, float]] = [{} for _ in range(n)]
        for g in groups:
            w = 1.0 / len(g)
            for i in g:
                rows[i] = {j: w for j in g}
        return cls(rows, groups)

    @classmethod
    def from_matrix(cls, w: torch.Tensor) -> _Round:
        n = w.shape[0]
        rows = [{j: float(w[i, j]) for j in range(n) if w[i, j] > 0} for i in range(n)]
        return cls(rows, _as_groups(w))


def _as_groups(w: torch.Tensor) -> Groups | None:
    """The group partition of ``w`` if it is a block of uniform averages, else None."""
    n = w.shape[0]
    seen: set[int] = set()
    groups: Groups = []
    for i in range(n):
        if i in seen:
            continue
        g = tuple(int(j) for j in torch.nonzero(w[i] > 0).flatten())
        if i not in g or any(j in seen for j in g):
            return None
        block = w[list(g)][:, list(g)]
        if not torch.allclose(block, torch.full_like(block, 1.0 / len(g)), rtol=0, atol=1e-12):
            return None
        groups.append(g)
        seen.update(g)
    # rows sum to 1 (validated), so a uniform block leaves nothing outside the group
    return groups


def second_singular_value(m: torch.Tensor) -> float:
    s = torch.linalg.svdvals(m)
    return float(s[1]) if s.numel() > 1 else 0.0

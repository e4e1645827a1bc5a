"""Communication graphs: the mixing matrix :math:`W^{(t)}` of every gossip round.

A topology is a periodic schedule of doubly stochastic matrices; round ``t`` uses
``W(t mod period)``. Every rank computes the same schedule from ``(world_size, step)`` alone,
without talking to the others, so all the logic that decides who sends to whom lives here, in
pure Python and torch, and can be checked on paper. This module never imports
:mod:`torch.distributed`.

Two shapes of round exist. Most built-in rounds are *group averages*: the ranks are partitioned
into groups and every member of a group ends with the plain mean of the group (ring pairs, the
whole world for ``complete``, the node blocks of ``alternating-exp-ring``). Such rounds can be
carried out with an all-reduce per group. A :class:`CustomTopology` may have arbitrary weights;
its rounds are only described by their rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property

import torch

__all__ = [
    "AlternatingExpRingTopology",
    "CompleteTopology",
    "CustomTopology",
    "OnePeerExpTopology",
    "RingTopology",
    "Topology",
    "get",
    "names",
]

_TOL = 1e-6  # tolerance for row/column sums of user-given matrices

Groups = list[tuple[int, ...]]


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


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
        _check_size("world_size", world_size)
        _check_size("local_world_size", local_world_size)
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
        return 1.0 - float(_second_singular_value(self.period_product()))

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


def _second_singular_value(m: torch.Tensor) -> float:
    s = torch.linalg.svdvals(m)
    return float(s[1]) if s.numel() > 1 else 0.0


class CompleteTopology(Topology):
    r"""Every worker averages with all others each round: :math:`W = \tfrac1n \mathbf 1 \mathbf 1^\top`.

    The same as global averaging; one all-reduce per round. Any world size.
    """

    @property
    def period(self) -> int:
        return 1

    def _round_groups(self, r: int) -> Groups:
        return [tuple(range(self.world_size))]


class RingTopology(Topology):
    r"""One peer per round on a ring, alternating between the left and the right neighbour.

    Even rounds pair ``(0,1), (2,3), ...``; odd rounds pair ``(1,2), (3,4), ...`` and, for even
    ``n``, ``(n-1, 0)``; a pair averages with weight 1/2. With odd ``n`` the worker left without
    a partner keeps its own value that round. Any world size.
    """

    @property
    def period(self) -> int:
        return 1 if self.world_size == 1 else 2

    def _round_groups(self, r: int) -> Groups:
        n = self.world_size
        if n <= 2:
            return [tuple(range(n))]
        first = r % 2
        groups: Groups = [(i, i + 1) for i in range(first, n - 1, 2)]
        paired = {i for g in groups for i in g}
        if n % 2 == 0 and first == 1:
            groups.append((0, n - 1))
            paired.update((0, n - 1))
        groups += [(i,) for i in range(n) if i not in paired]
        return groups


class OnePeerExpTopology(Topology):
    r"""One-peer exponential graph (hypercube): round ``r`` pairs ``i`` with ``i XOR 2^r``.

    After :math:`\log_2 n` consecutive rounds the product of the matrices is exactly
    :math:`\tfrac1n \mathbf 1 \mathbf 1^\top`: a full average at the cost of one peer per round.
    Needs a power-of-two world size.
    """

    def __init__(self, world_size: int, local_world_size: int = 1) -> None:
        super().__init__(world_size, local_world_size)
        if not _is_power_of_two(world_size):
            raise ValueError(
                f"one-peer-exp needs a power-of-two world size (1, 2, 4, 8, ...), got {world_size}"
            )

    @property
    def period(self) -> int:
        return max(1, self.world_size.bit_length() - 1)

    def _round_groups(self, r: int) -> Groups:
        n = self.world_size
        if n == 1:
            return [(0,)]
        bit = 1 << r
        return [(i, i | bit) for i in range(n) if not i & bit]


class AlternatingExpRingTopology(Topology):
    r"""Node-aware exponential graph: rounds alternate between intra-node and inter-node averages.

    With ``nodes = n / local_world_size`` (a power of two, at least 2), for each
    ``r < log2(nodes)`` node ``j`` is paired with node ``j XOR 2^r``, and two rounds are made: in
    one, each node averages its own workers (weight ``1/L``); in the other, the ``2L`` workers of
    the node pair average together (weight ``1/(2L)``). Successive node pairs alternate which of
    the two rounds is the inter-node one, so in each round only about half of the pairs use the
    slow links between nodes. One worker: ``W = I``.
    """

    def __init__(self, world_size: int, local_world_size: int = 1) -> None:
        super().__init__(world_size, local_world_size)
        nodes = world_size // local_world_size
        if world_size > 1 and (nodes < 2 or not _is_power_of_two(nodes)):
            raise ValueError(
                "alternating-exp-ring needs world_size = nodes * local_world_size with nodes a "
                f"power of two >= 2 (nodes = 2, 4, 8, ...); got world_size={world_size}, "
                f"local_world_size={local_world_size} ({world_size / local_world_size:g} nodes)"
            )
        self._nodes = nodes

    @property
    def period(self) -> int:
        return 1 if self.world_size == 1 else 2 * (self._nodes.bit_length() - 1)

    @cached_property
    def _schedule(self) -> list[Groups]:
        local = self.local_world_size

        def workers(*nodes: int) -> tuple[int, ...]:
            return tuple(w for node in nodes for w in range(node * local, (node + 1) * local))

        rounds: list[Groups] = []
        pair_index = 0
        for r in range(self._nodes.bit_length() - 1):
            bit = 1 << r
            first: Groups = []
            second: Groups = []
            for a in range(self._nodes):
                if a & bit:
                    continue
                b = a | bit
                intra, inter = [workers(a), workers(b)], [workers(a, b)]
                first += intra if pair_index % 2 == 0 else inter
                second += inter if pair_index % 2 == 0 else intra
                pair_index += 1
            rounds += [first, second]
        return rounds

    def _round_groups(self, r: int) -> Groups:
        if self.world_size == 1:
            return [(0,)]
        return self._schedule[r]


class CustomTopology(Topology):
    """A user-given periodic schedule of doubly stochastic matrices.

    Each round is an ``(n, n)`` matrix (tensor or nested lists) or a list of ``n`` rows given as
    ``{source: weight}`` dicts. The schedule is validated: square, one size for all rounds,
    non-negative, rows and columns summing to 1 (within 1e-6), and the product over one period
    must mix (second singular value < 1), otherwise the workers would never agree.

    Example::

        # a path 0 - 1 - 2 with Metropolis weights, the same every round
        w = [[2/3, 1/3, 0], [1/3, 1/3, 1/3], [0, 1/3, 2/3]]
        topo = CustomTopology([w])
    """

    def __init__(
        self,
        schedule: Sequence[
            torch.Tensor | Sequence[Sequence[float]] | Sequence[Mapping[int, float]]
        ],
        local_world_size: int = 1,
    ) -> None:
        if isinstance(schedule, torch.Tensor) or not isinstance(schedule, Sequence) or not schedule:
            raise ValueError(
                "schedule must be a non-empty list of rounds (matrices or lists of row dicts); "
                f"got {type(schedule).__name__}"
            )
        matrices = [_to_matrix(r, rnd) for r, rnd in enumerate(schedule)]
        n = matrices[0].shape[0]
        for r, m in enumerate(matrices):
            _validate_round(r, m, n)
        super().__init__(n, local_world_size)
        self._matrices = matrices
        if n > 1:
            sigma2 = _second_singular_value(self.period_product())
            if sigma2 >= 1 - 1e-9:
                raise ValueError(
                    "schedule does not mix: the product of its rounds has second singular value "
                    f"{sigma2:.6g} (must be < 1); some workers never exchange values"
                )

    @property
    def period(self) -> int:
        return len(self._matrices)

    def _round_matrix(self, r: int) -> torch.Tensor:
        return self._matrices[r]


def _to_matrix(r: int, rnd: object) -> torch.Tensor:
    if isinstance(rnd, torch.Tensor):
        m = rnd.detach().to(device="cpu", dtype=torch.float64)
    elif isinstance(rnd, Sequence) and rnd and all(isinstance(row, Mapping) for row in rnd):
        n = len(rnd)
        m = torch.zeros(n, n, dtype=torch.float64)
        for i, row in enumerate(rnd):
            for j, w in row.items():
                if not (isinstance(j, int) and 0 <= j < n):
                    raise ValueError(
                        f"round {r}: row {i} names source {j!r}, expected a rank in [0, {n})"
                    )
                m[i, j] = float(w)
    else:
        try:
            m = torch.tensor(rnd, dtype=torch.float64)
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"round {r}: cannot read a matrix from {type(rnd).__name__}: {err}"
            ) from None
    if m.dim() != 2 or m.shape[0] != m.shape[1] or m.shape[0] == 0:
        raise ValueError(
            f"round {r}: mixing matrix must be square (n, n), got shape {tuple(m.shape)}"
        )
    return m


def _validate_round(r: int, m: torch.Tensor, n: int) -> None:
    if m.shape[0] != n:
        raise ValueError(f"round {r}: matrix is {m.shape[0]}x{m.shape[0]}, but round 0 is {n}x{n}")
    if not torch.isfinite(m).all():
        raise ValueError(f"round {r}: mixing matrix has non-finite entries")
    if (m < 0).any():
        i, j = (int(k) for k in torch.nonzero(m < 0)[0])
        raise ValueError(f"round {r}: entry ({i}, {j}) is {float(m[i, j]):g}, weights must be >= 0")
    for axis, what in ((1, "row"), (0, "column")):
        sums = m.sum(dim=axis)
        bad = torch.nonzero((sums - 1).abs() > _TOL).flatten()
        if bad.numel():
            k = int(bad[0])
            raise ValueError(
                f"round {r}: {what} {k} sums to {float(sums[k]):.6g}, expected 1 "
                "(mixing matrices must be doubly stochastic)"
            )


_NAMED: dict[str, type[Topology]] = {
    "complete": CompleteTopology,
    "ring": RingTopology,
    "one-peer-exp": OnePeerExpTopology,
    "alternating-exp-ring": AlternatingExpRingTopology,
}


def names() -> list[str]:
    """The names :func:`get` accepts."""
    return list(_NAMED)


def get(name: str | Topology, world_size: int, local_world_size: int = 1) -> Topology:
    """The topology called ``name`` for ``world_size`` workers (a :class:`Topology` passes through).

    Raises:
        ValueError: unknown name, or a world size the topology does not fit; the message says
            which names or sizes are valid.
    """
    if isinstance(name, Topology):
        if name.world_size != world_size:
            raise ValueError(
                f"topology {name!r} is built for world_size={name.world_size}, "
                f"but the process group has {world_size} ranks"
            )
        return name
    if not isinstance(name, str):
        raise TypeError(f"topology must be a name (str) or a Topology, got {type(name).__name__}")
    cls = _NAMED.get(name)
    if cls is None:
        valid = ", ".join(repr(k) for k in _NAMED)
        raise ValueError(f"unknown topology {name!r}; valid names are {valid}, or pass a Topology")
    return cls(world_size, local_world_size)

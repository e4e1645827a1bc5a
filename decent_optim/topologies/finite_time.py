r"""Base-``b`` graphs: groups of up to ``b`` workers per round, the exact mean in a few rounds.

Write each rank in a mixed radix whose digits ``d_0, d_1, ...`` have the bases
``f_0, f_1, ...`` (``n = f_0 f_1 \cdots``, every ``f_r <= b``, found greedily from the largest
divisor). Round ``r`` averages, uniformly, the ``f_r`` ranks that differ only in digit ``r``.
After one period (one round per digit) every rank holds the exact mean:

.. math::
    W^{(m-1)} \cdots W^{(1)} W^{(0)} = \tfrac1n \mathbf 1 \mathbf 1^\top ,

because each round replaces one digit's values by their mean, and the means over the digits in
turn are the mean over all ranks. Each worker exchanges with ``f_r - 1 <= b - 1`` peers a round.
With ``n`` a power of ``b`` the period is :math:`\log_b n` (the Base-(k+1) graph of Takezawa et
al., arXiv 2305.11420, with ``k = b - 1``, for those sizes); ``base-2`` is ``one-peer-exp``.
Consecutive ranks share the first digit, so with the usual rank layout a node's workers meet in
round 0. Other world sizes need prime factors no larger than ``b``. Pure Python, no
communication.
"""

from __future__ import annotations

from decent_optim.topologies.base import Groups, Topology, check_size

__all__ = ["BaseTopology", "digit_bases"]


def digit_bases(n: int, base: int) -> list[int]:
    """The bases of the digits, each the largest divisor ``<= base`` of what is left of ``n``.

    Raises:
        ValueError: ``n`` has a prime factor larger than ``base``.
    """
    left, bases = n, []
    while left > 1:
        f = next((d for d in range(min(base, left), 1, -1) if left % d == 0), None)
        if f is None:
            raise ValueError(
                f"base-{base} needs a world size whose prime factors are all at most {base}; "
                f"{n} has the factor {left if _is_prime(left) else _smallest_factor(left)}: "
                f"pass a larger base, or topology='ring'"
            )
        bases.append(f)
        left //= f
    return bases


def _smallest_factor(n: int) -> int:
    return next(d for d in range(2, n + 1) if n % d == 0)


def _is_prime(n: int) -> bool:
    return n > 1 and _smallest_factor(n) == n


class BaseTopology(Topology):
    """``base-<b>``: round ``r`` averages the ranks that differ only in digit ``r`` of a mixed
    radix (:doc:`/topologies`); one period gives the exact mean.

    Args:
        world_size: number of workers ``n``.
        local_world_size: workers per node (not used by the schedule: a node's consecutive ranks
            share the first digit and meet in round 0).
        base: the largest group, ``b >= 2`` (``b - 1`` peers a round).
    """

    def __init__(self, world_size: int, local_world_size: int = 1, base: int = 4) -> None:
        super().__init__(world_size, local_world_size)
        if check_size("base", base) < 2:
            raise ValueError(f"base must be at least 2, got {base}")
        self.base = base
        self._bases = digit_bases(world_size, base)
        self._places = [1]
        for f in self._bases:
            self._places.append(self._places[-1] * f)

    @property
    def period(self) -> int:
        return max(1, len(self._bases))

    def _round_groups(self, r: int) -> Groups:
        n = self.world_size
        if n == 1:
            return [(0,)]
        f, place = self._bases[r], self._places[r]
        heads = [i for i in range(n) if (i // place) % f == 0]
        return [tuple(h + d * place for d in range(f)) for h in heads]

    def __repr__(self) -> str:
        return f"BaseTopology(world_size={self.world_size}, base={self.base})"

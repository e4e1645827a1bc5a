"""The named topologies: complete, ring, one-peer exponential and alternating exponential ring."""

from __future__ import annotations

from functools import cached_property

from decent_optim.topologies.base import Groups, Topology, is_power_of_two

__all__ = [
    "AlternatingExpRingTopology",
    "CompleteTopology",
    "OnePeerExpTopology",
    "RingTopology",
]


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
        if not is_power_of_two(world_size):
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


def _instead_of_aer(world_size: int, nodes: int) -> str:
    """What to pass instead of alternating-exp-ring on ``nodes`` nodes (its refusal's end)."""
    others = 'topology="ring"'
    if is_power_of_two(world_size):
        others += ' or topology="one-peer-exp"'
    if nodes > 1:
        return f"With {nodes} nodes, pass {others}, or run on a power-of-two number of nodes"
    instead = f"On one node, pass {others} (one peer per round)"
    if is_power_of_two(world_size):  # every worker a node: `world_size` nodes
        instead += (
            ", or local_world_size=1 to treat every worker as a node (compression=, if "
            "given, then applies to every exchange)"
        )
    return instead


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
        if world_size > 1 and (nodes < 2 or not is_power_of_two(nodes)):
            raise ValueError(
                "alternating-exp-ring needs world_size = nodes * local_world_size with nodes a "
                f"power of two >= 2 (nodes = 2, 4, 8, ...); got world_size={world_size}, "
                f"local_world_size={local_world_size} ({nodes} node{'s' * (nodes != 1)}). "
                + _instead_of_aer(world_size, nodes)
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

"""Communication times from message sizes and link bandwidths (no measurement needed).

Ranks are numbered node by node; every node has one uplink of bandwidth ``inter_bw`` in each
direction shared by its workers, traffic inside a node moves at ``intra_bw`` per worker.

A group of a round whose ranks sit on several nodes, with the same number :math:`L > 1` on each
of :math:`p` nodes, averages by node (:mod:`decent_optim.gossip.nodes`): its members exchange
:math:`(L-1)/L` of the buffer inside the node before and after, and each sends its :math:`1/L`
shard to its counterpart on each of the other :math:`p - 1` nodes, so an uplink carries
:math:`p - 1` copies of the buffer per direction. With ``compression`` the groups that cross
nodes send, instead of the float copies, :func:`wire_bytes` (bf16: 2 bytes per element, int8:
1 byte plus a float32 scale per 1024 elements, the sparse and low-bit codecs of
:mod:`~decent_optim.runtime.wire` what their payloads hold); other groups are modelled as exact.
"""

from __future__ import annotations

from decent_optim.runtime.schedule import Schedule
from decent_optim.runtime.wire import bytes_per_element

__all__ = ["WIRE_BYTES", "allreduce_time", "gossip_round_times", "parse_rate", "wire_bytes"]

#: bytes on the wire per element of the fixed-name codecs (any name of
#: :mod:`~decent_optim.runtime.wire`'s grammar works in :func:`wire_bytes`)
WIRE_BYTES = {name: bytes_per_element(name) for name in ("bf16", "int8", "int4", "int2")}


_BITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8}
_RATE_UNITS = {**_BITS, "bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9}


def parse_rate(rate: str | float) -> float:
    """Bandwidth in bytes/s from a number (bytes/s) or tc syntax (``"100mbit"``, ``"1gbit"``)."""
    if isinstance(rate, (int, float)):
        value = float(rate)
    else:
        text = rate.strip().lower()
        unit = next(
            (u for u in sorted(_RATE_UNITS, key=len, reverse=True) if text.endswith(u)), None
        )
        if unit is None:
            raise ValueError(f"rate must look like '100mbit', '1gbit' or '2gbps', got {rate!r}")
        try:
            value = float(text[: -len(unit)]) * _RATE_UNITS[unit]
        except ValueError:
            raise ValueError(
                f"rate must look like '100mbit', '1gbit' or '2gbps', got {rate!r}"
            ) from None
    if not value > 0:
        raise ValueError(f"rate must be > 0, got {rate!r}")
    return value


def wire_bytes(nbytes: float, compression: str | None, element_size: int = 4) -> float:
    """Bytes that cross a link for a copy of ``nbytes`` (elements of ``element_size`` bytes)."""
    if compression is None:
        return nbytes
    return nbytes / element_size * bytes_per_element(compression)


def _node_parts(group: tuple[int, ...], local: int) -> list[tuple[int, ...]]:
    """The group split by node; single ranks when the nodes hold unequal numbers of members."""
    nodes: dict[int, list[int]] = {}
    for r in group:
        nodes.setdefault(r // local, []).append(r)
    parts = [tuple(m) for _, m in sorted(nodes.items())]
    return parts if len({len(p) for p in parts}) == 1 else [(r,) for r in group]


def _check_link(nbytes: float, intra_bw: float, inter_bw: float, latency: float) -> None:
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    if not (intra_bw > 0 and inter_bw > 0):
        raise ValueError(
            f"bandwidths must be > 0, got intra_bw={intra_bw!r}, inter_bw={inter_bw!r}"
        )
    if latency < 0:
        raise ValueError(f"latency must be >= 0, got {latency!r}")


def allreduce_time(
    nbytes: float,
    world_size: int,
    local_world_size: int,
    intra_bw: float,
    inter_bw: float,
    latency: float = 0.0,
) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` over ``world_size`` workers.

    Every worker sends ``2 (n-1)/n * nbytes`` in ``2 (n-1)`` messages; with the ranks numbered
    node by node one hop of the ring leaves each node, so each uplink carries the same amount.
    """
    _check_link(nbytes, intra_bw, inter_bw, latency)
    n = world_size
    if n <= 1:
        return 0.0
    volume = 2 * (n - 1) / n * nbytes
    bw = inter_bw if n > local_world_size else intra_bw
    return volume / bw + 2 * (n - 1) * latency


def gossip_round_times(
    topology: Schedule,
    nbytes: float,
    intra_bw: float,
    inter_bw: float,
    latency: float = 0.0,
    *,
    compression: str | None = None,
    element_size: int = 4,
) -> list[float]:
    """Seconds of each round of ``topology``'s period when every worker gossips ``nbytes``.

    A round lasts as long as its most loaded link: a node's uplink (bytes its workers send to
    other nodes, over ``inter_bw``) or a worker's own traffic inside its node (over ``intra_bw``).
    ``compression`` (None, ``"bf16"``, ``"int8"``) shrinks what groups across nodes send, for
    parameters of ``element_size`` bytes (module docstring).
    """
    _check_link(nbytes, intra_bw, inter_bw, latency)
    wire = wire_bytes(nbytes, compression, element_size)
    n, local = topology.world_size, topology.local_world_size
    node = [r // local for r in range(n)]
    times = []
    for r in range(topology.period):
        uplink = [0.0] * (n // local)
        intra = [0.0] * n
        messages = 0
        groups = topology.groups(r)
        if groups is None:  # arbitrary weights: point to point to every out-neighbour
            groups = []
            for i in range(n):
                for j in topology.out_peers(i, r):
                    if node[i] == node[j]:
                        intra[i] += nbytes
                    else:
                        uplink[node[i]] += nbytes
                messages = max(messages, len(topology.out_peers(i, r)))
        for g in groups:
            k = len(g)
            if k == 1:
                continue
            parts = _node_parts(g, local)
            crosses = len({node[i] for i in g}) > 1
            if crosses and (compression is not None or len(parts[0]) > 1):
                messages = max(messages, _by_node(parts, node, nbytes, wire, uplink, intra))
                continue
            if k == 2:  # one send each way
                volume, msgs = nbytes, 1
            else:  # ring all-reduce inside the group
                volume, msgs = 2 * (k - 1) / k * nbytes, 2 * (k - 1)
            messages = max(messages, msgs)
            spanned = sorted({node[i] for i in g})
            if len(spanned) > 1:
                for a in spanned:  # one ring hop (or, for a pair, one message) leaves each node
                    uplink[a] += volume
            if k > 2 or len(spanned) == 1:
                for i in g:
                    intra[i] += volume
        busiest = max(max(uplink) / inter_bw, max(intra) / intra_bw)
        times.append(busiest + messages * latency if busiest or messages else 0.0)
    return times


def _by_node(
    parts: list[tuple[int, ...]],
    node: list[int],
    nbytes: float,
    wire: float,
    uplink: list[float],
    intra: list[float],
) -> int:
    """Add one by-node group round's traffic (module docstring); returns its messages per rank."""
    width = len(parts[0])
    for a, part in enumerate(parts):
        for slot, i in enumerate(part):
            intra[i] += 2 * (width - 1) / width * nbytes  # the part's mean, then the gather
            for b, other in enumerate(parts):
                if b == a:
                    continue
                j = other[slot]
                if node[i] == node[j]:
                    intra[i] += wire / width
                else:
                    uplink[node[i]] += wire / width
    return 2 * (width - 1) + len(parts) - 1

"""Communication times from message sizes and link bandwidths (no measurement needed).

Ranks are numbered node by node; every node has one uplink of bandwidth ``inter_bw`` in each
direction shared by its workers, traffic inside a node moves at ``intra_bw`` per worker.
"""

from __future__ import annotations

from decent_optim.runtime.schedule import Schedule

__all__ = ["allreduce_time", "gossip_round_times", "parse_rate"]


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
) -> list[float]:
    """Seconds of each round of ``topology``'s period when every worker gossips ``nbytes``.

    A round lasts as long as its most loaded link: a node's uplink (bytes its workers send to
    other nodes, over ``inter_bw``) or a worker's own traffic inside its node (over ``intra_bw``).
    """
    _check_link(nbytes, intra_bw, inter_bw, latency)
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

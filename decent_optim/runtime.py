r"""Runtime model: predicted time per training iteration for All-Reduce and for gossip.

Pure Python (no torch, no torch.distributed), so it can be evaluated anywhere, e.g. on numbers
that :mod:`decent_optim.plan` measured on a cluster. The quantities are those of the paper's
runtime model (see ``algorithms.md``): the compute time per iteration and its spread across
workers (stragglers), the time of one all-reduce of the model, and the time of one gossip round
of each topology.

Model
-----
Worker :math:`i` needs :math:`C_i(t)` seconds for the forward and backward pass of iteration
:math:`t`, then :math:`u` seconds for its local optimizer step (and, for gossip, the mixing).

*All-Reduce (DDP)*. Every iteration ends with an all-reduce of the gradients over all ``n``
workers, so each iteration waits for the slowest worker. DDP starts reducing gradient buckets
while the backward pass still runs, which hides part of the all-reduce time :math:`A`, at most
the backward pass (a fraction :math:`b` of the compute):

.. math::
    T_{AR} = \mathbb{E}\big[\max_{i \le n} C_i\big] + A - \min(\rho A,\; b\,\mu) + u

where :math:`\rho \in [0, 1]` is the overlappable fraction of the all-reduce (1: everything but
nothing beyond the backward pass hides; 0: no overlap).

*Gossip (decentralized)*. The round launched at the end of a step travels during the whole next
forward and backward and is waited for only at the next step; a worker waits for its own
neighbours only. With :math:`k_r` in-neighbours in round :math:`r` and :math:`G_r` the time of
that round's exchange, an iteration of round :math:`r` takes

.. math::
    T_r = \max\Big(\mathbb{E}\big[\max_{i \le k_r + 1} C_i\big],\; G_r\Big) + u

and the prediction is the mean of :math:`T_r` over the topology's period.

Assumptions
-----------
* Compute times are independent across workers and iterations and normal,
  :math:`C_i(t) \sim N(\mu, \sigma^2)`; :math:`\mathbb{E}[\max_{i \le k} C_i] = \mu + \sigma e_k`
  with :math:`e_k` the expected maximum of ``k`` standard normals (:func:`expected_max_normal`).
* A gossip round only couples a worker with its neighbours. Delays also propagate over longer
  paths in later rounds, so with stragglers the true gossip iteration time lies between this
  prediction and the one with ``k_r + 1`` replaced by ``n``; with :math:`\sigma = 0` both agree.
* Communication runs beside compute without slowing it down (true for GPUs with a copy engine
  or NCCL; on CPUs the transport competes with compute for cores, so the measured times there
  are somewhat longer than predicted).
* Communication times come either measured (:mod:`decent_optim.plan`) or from message size and
  link bandwidths (:func:`allreduce_time`, :func:`gossip_round_times`): ranks are numbered node
  by node, every node has one uplink of bandwidth ``inter_bw`` in each direction shared by its
  workers, traffic inside a node moves at ``intra_bw`` per worker, groups of three or more
  average by a ring all-reduce (about ``2 (k-1)/k`` messages per worker), pairs by one send and
  one receive each (what :class:`~decent_optim.gossip.Gossiper` does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "Prediction",
    "Workload",
    "allreduce_time",
    "expected_max_normal",
    "gossip_round_times",
    "parse_rate",
    "predict_allreduce",
    "predict_gossip",
    "recommend",
    "round_degrees",
]


class _Schedule(Protocol):  # what the model needs of a decent_optim Topology
    @property
    def world_size(self) -> int: ...
    @property
    def local_world_size(self) -> int: ...
    @property
    def period(self) -> int: ...

    def groups(self, step: int) -> list[tuple[int, ...]] | None: ...
    def out_peers(self, rank: int, step: int) -> list[int]: ...
    def in_peers(self, rank: int, step: int) -> list[int]: ...


@dataclass(frozen=True)
class Workload:
    """Per-worker compute of one iteration, in seconds.

    Args:
        compute_mean: mean forward + backward time :math:`\\mu`.
        compute_std: standard deviation :math:`\\sigma` of it across workers and iterations.
        update_time: local optimizer step (plus mixing), not overlapped with anything.
        backward_fraction: share :math:`b` of the compute that is the backward pass, the window
            in which DDP can reduce gradients (about 2/3: backward costs twice the forward).
    """

    compute_mean: float
    compute_std: float = 0.0
    update_time: float = 0.0
    backward_fraction: float = 2 / 3

    def __post_init__(self) -> None:
        for name in ("compute_mean", "compute_std", "update_time"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not 0 <= self.backward_fraction <= 1:
            raise ValueError(f"backward_fraction must be in [0, 1], got {self.backward_fraction!r}")

    def expected_max(self, k: int) -> float:
        """Expected slowest compute time among ``k`` workers."""
        return self.compute_mean + self.compute_std * expected_max_normal(k)


@dataclass(frozen=True)
class Prediction:
    """Predicted seconds per iteration, with the parts it is made of."""

    method: str
    iteration: float
    compute: float  # expected compute a worker waits for (slowest it depends on)
    comm: float  # communication time per iteration (mean over rounds for gossip)
    exposed_comm: float  # the part of comm not hidden behind compute
    details: dict = field(default_factory=dict)

    @property
    def overlap_efficiency(self) -> float:
        """``max(compute + update, comm) / iteration``: 1.0 when communication is fully hidden.

        The iteration can be no shorter than its compute or its communication; the ratio says
        how close it comes to that bound (lower: the two add up instead of overlapping).
        """
        bound = max(self.compute + self.details.get("update", 0.0), self.comm)
        return bound / self.iteration if self.iteration > 0 else 1.0


# -- order statistics ---------------------------------------------------------------------------
_EMAX_CACHE: dict[int, float] = {}


def expected_max_normal(k: int) -> float:
    """``E[max(Z_1..Z_k)]`` for independent standard normals ``Z`` (0 for k = 1).

    Numerical integration of ``E[max] = int z k phi(z) Phi(z)^(k-1) dz`` (Simpson's rule on
    [-12, 12]; error far below 1e-9 for k up to thousands).
    """
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    if k == 1:
        return 0.0
    cached = _EMAX_CACHE.get(k)
    if cached is not None:
        return cached
    lo, hi, steps = -12.0, 12.0, 4800
    h = (hi - lo) / steps
    total = 0.0
    for s in range(steps + 1):
        z = lo + s * h
        phi = math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1.0 + math.erf(z / math.sqrt(2)))
        f = z * k * phi * cdf ** (k - 1)
        total += f * (1 if s in (0, steps) else 4 if s % 2 else 2)
    value = total * h / 3
    _EMAX_CACHE[k] = value
    return value


# -- communication from bandwidths --------------------------------------------------------------
_RATE_UNITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8,
               "bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9}  # fmt: skip


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
    topology: _Schedule,
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


def round_degrees(topology: _Schedule) -> list[int]:
    """Largest number of in-neighbours of any worker, for each round of the period."""
    n = topology.world_size
    return [max(len(topology.in_peers(i, r)) for i in range(n)) for r in range(topology.period)]


# -- predictions --------------------------------------------------------------------------------
def predict_allreduce(
    workload: Workload, world_size: int, allreduce_s: float, overlap: float = 1.0
) -> Prediction:
    """All-Reduce data parallelism (DDP); see the module docstring for the formula.

    Args:
        workload: compute per worker.
        world_size: workers ``n``; every iteration waits for the slowest of them.
        allreduce_s: seconds of one all-reduce of the gradients.
        overlap: fraction ``rho`` of the all-reduce that may hide behind the backward pass.
    """
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap must be in [0, 1], got {overlap!r}")
    if allreduce_s < 0:
        raise ValueError(f"allreduce_s must be >= 0, got {allreduce_s!r}")
    compute = workload.expected_max(max(world_size, 1))
    hidden = min(overlap * allreduce_s, workload.backward_fraction * workload.compute_mean)
    exposed = allreduce_s - hidden
    return Prediction(
        "all-reduce", compute + exposed + workload.update_time, compute, allreduce_s, exposed,
        {"hidden": hidden, "update": workload.update_time},
    )  # fmt: skip


def predict_gossip(
    workload: Workload, round_s: Sequence[float], degrees: Sequence[int], name: str = "gossip"
) -> Prediction:
    """Decentralized training with gossip overlapped with the next forward and backward.

    Args:
        workload: compute per worker.
        round_s: seconds of each round's exchange over the topology's period.
        degrees: in-neighbours of a worker in each round (:func:`round_degrees`).
        name: label of the result (the topology's name).
    """
    if len(round_s) != len(degrees) or not round_s:
        raise ValueError(
            f"round_s and degrees must be non-empty and of equal length, got {len(round_s)} "
            f"and {len(degrees)}"
        )
    per_round, waits, exposed = [], [], []
    for g, k in zip(round_s, degrees):
        if g < 0:
            raise ValueError(f"round times must be >= 0, got {g!r}")
        wait = workload.expected_max(k + 1)
        waits.append(wait)
        per_round.append(max(wait, g) + workload.update_time)
        exposed.append(max(0.0, g - wait))
    mean = sum(per_round) / len(per_round)
    return Prediction(
        name, mean, sum(waits) / len(waits), sum(round_s) / len(round_s),
        sum(exposed) / len(exposed), {"rounds": list(per_round), "update": workload.update_time},
    )  # fmt: skip


def recommend(
    workload: Workload,
    world_size: int,
    allreduce_s: float,
    gossip: dict[str, tuple[Sequence[float], Sequence[int]]],
    overlap: float = 1.0,
) -> list[tuple[Prediction, float]]:
    """Predictions for All-Reduce and each topology, fastest first, with speedup over All-Reduce.

    Args:
        gossip: ``{topology name: (round times, round degrees)}``.
    """
    base = predict_allreduce(workload, world_size, allreduce_s, overlap)
    preds = [base] + [predict_gossip(workload, t, d, name) for name, (t, d) in gossip.items()]
    preds.sort(key=lambda p: p.iteration)
    return [(p, base.iteration / p.iteration if p.iteration > 0 else 1.0) for p in preds]

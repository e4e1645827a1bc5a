"""The runtime model's predictions: time per iteration for All-Reduce and for gossip.

The model and its assumptions are stated in :mod:`decent_optim.runtime`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from decent_optim.runtime.schedule import Schedule

__all__ = [
    "Prediction",
    "Workload",
    "expected_max_normal",
    "predict_allreduce",
    "predict_gossip",
    "recommend",
    "round_degrees",
]


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


# -- predictions --------------------------------------------------------------------------------
def round_degrees(topology: Schedule) -> list[int]:
    """Largest number of in-neighbours of any worker, for each round of the period."""
    n = topology.world_size
    return [max(len(topology.in_peers(i, r)) for i in range(n)) for r in range(topology.period)]


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
        "all-reduce",
        compute + exposed + workload.update_time,
        compute,
        allreduce_s,
        exposed,
        {"hidden": hidden, "update": workload.update_time},
    )


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
        name,
        mean,
        sum(waits) / len(waits),
        sum(round_s) / len(round_s),
        sum(exposed) / len(exposed),
        {"rounds": list(per_round), "update": workload.update_time},
    )


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

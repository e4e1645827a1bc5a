r"""The runtime model on workers of uneven speed: who waits for the slowest, and who does not.

Worker :math:`i` runs at speed :math:`s_i` (1: the measured compute :math:`\mu`; 0.5: twice as
slow), so its step takes :math:`\mu / s_i`.

*Step-locked methods* (All-Reduce, gossip every step or every :math:`H` steps, DiLoCo) wait for
the slowest worker at every round, so they run as if every worker took the slowest one's time:
:func:`paced` turns the workload into that one (:math:`\mu / \min_i s_i`, the spread alike) for
the formulas of :mod:`~decent_optim.runtime.model` and :mod:`~decent_optim.runtime.local_steps`.

*Uneven periods* (``uneven=True``, :mod:`decent_optim.optim.uneven`): a period lasts the
slowest worker's :math:`H` steps, :math:`P = H \mu / \min_i s_i` (or the round's time
:math:`G_r` if longer), and worker :math:`i` takes :math:`P s_i / \mu` steps in it. In
DDP-equivalent steps (the workers' steps summed over :math:`n`) a period is
:math:`E = P \bar s / \mu`, :math:`\bar s` the mean speed, so per DDP-equivalent step

.. math::
    T_r = \frac{\max(P, G_r) + E u}{E} = \frac{\mu}{\bar s} \cdot \frac{\max(P, G_r)}{P} + u,

averaged over the topology's period: :math:`\mu / \bar s` when the rounds fit in the periods,
whatever the slowest worker does. One worker of four at half speed: :math:`\bar s = 0.875`,
1.14x the even time, where the step-locked methods take 2x.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from decent_optim.runtime.model import Prediction, Workload

__all__ = ["check_speeds", "paced", "predict_uneven"]


def check_speeds(speeds: Sequence[float], world_size: int | None = None) -> list[float]:
    """The speeds as floats; a clear error for anything but ``world_size`` positive numbers."""
    out = [float(s) for s in speeds]
    if not out or not all(s > 0 for s in out):
        raise ValueError(f"speeds must be positive numbers, one per worker, got {list(speeds)!r}")
    if world_size is not None and len(out) != world_size:
        raise ValueError(f"speeds needs one factor per worker ({world_size}), got {len(out)}")
    return out


def paced(workload: Workload, speeds: Sequence[float]) -> Workload:
    """The workload of the slowest worker: what a step-locked method runs at."""
    slowest = min(check_speeds(speeds))
    return replace(
        workload,
        compute_mean=workload.compute_mean / slowest,
        compute_std=workload.compute_std / slowest,
    )


def predict_uneven(
    workload: Workload,
    speeds: Sequence[float],
    round_s: Sequence[float],
    local_steps: int,
    name: str = "gossip",
) -> Prediction:
    """Seconds per DDP-equivalent step of ``uneven=True`` with ``local_steps`` (module docstring).

    Args:
        workload: compute of a speed-1 worker.
        speeds: each worker's speed factor.
        round_s: seconds of each round's exchange over the topology's period.
        local_steps: :math:`H`, the fewest steps of a period.
        name: label of the result.
    """
    s = check_speeds(speeds)
    if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
        raise ValueError(f"local_steps must be an int >= 1, got {local_steps!r}")
    if not round_s or any(g < 0 for g in round_s):
        raise ValueError("round_s must be non-empty times >= 0")
    mu, u = workload.compute_mean, workload.update_time
    mean_speed = sum(s) / len(s)
    period = local_steps * mu / min(s)
    compute = mu / mean_speed
    per = [compute * max(period, g) / period + u if period > 0 else g + u for g in round_s]
    exposed = [compute * max(0.0, g - period) / period if period > 0 else g for g in round_s]
    return Prediction(
        f"{name} H={local_steps} uneven",
        sum(per) / len(per),
        compute,
        sum(round_s) / len(round_s) / max(local_steps * mean_speed / min(s), 1e-12),
        sum(exposed) / len(exposed),
        {"rounds": per, "update": u, "local_steps": local_steps, "mean_speed": mean_speed},
    )

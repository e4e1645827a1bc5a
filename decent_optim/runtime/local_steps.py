r"""The runtime model with local steps: gossip every :math:`H` steps, or DiLoCo's all-reduce.

*Gossip every H steps* (``local_steps=H`` without ``outer``; with ``outer`` the round is waited
for at the end of its period, which the DiLoCo formula below describes with :math:`A` the
round's time and :math:`n` the round's group size). The round launched at the end of a period travels
during the whole next period, :math:`H` forward/backward passes and updates, and is waited for
at its end; a worker then waits for its :math:`k_r` in-neighbours' periods too. A period's
compute is the sum of :math:`H` independent normal times, :math:`N(H\mu, H\sigma^2)`, so with
:math:`G_r` the time of the round of the :math:`r`-th communication

.. math::
    T_r = \frac{1}{H}\Big(\max\big(H\mu + \sqrt{H}\,\sigma\, e_{k_r + 1},\; G_r\big) + H u\Big)

per iteration, averaged over the topology's period (:math:`e_k` as in
:func:`~decent_optim.runtime.expected_max_normal`; the outer step, one pass over the parameters
per period, is counted in :math:`u`'s error). With :math:`H = 1` it is
:func:`~decent_optim.runtime.predict_gossip`.

*DiLoCo with all-reduce*. Every :math:`H` steps all :math:`n` workers wait for the slowest and
all-reduce the pseudo-gradients, blocking (nothing to overlap with):

.. math::
    T_{DiLoCo} = \frac{1}{H}\Big(H\mu + \sqrt{H}\,\sigma\, e_n + A\Big) + u .
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from decent_optim.runtime.model import Prediction, Workload, expected_max_normal

__all__ = ["predict_diloco", "predict_local_steps"]


def _check(local_steps: int) -> None:
    if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
        raise ValueError(f"local_steps must be an int >= 1, got {local_steps!r}")


def _period_compute(workload: Workload, local_steps: int, k: int) -> float:
    """Expected slowest of ``k`` workers' compute over ``local_steps`` iterations."""
    spread = math.sqrt(local_steps) * workload.compute_std * expected_max_normal(k)
    return local_steps * workload.compute_mean + spread


def predict_local_steps(
    workload: Workload,
    round_s: Sequence[float],
    degrees: Sequence[int],
    local_steps: int,
    name: str = "gossip",
) -> Prediction:
    """Gossip every ``local_steps`` iterations, each round overlapped with the next period.

    Args:
        workload: compute per worker.
        round_s: seconds of each round's exchange over the topology's period.
        degrees: in-neighbours of a worker in each round.
        local_steps: :math:`H`.
        name: label of the result.
    """
    _check(local_steps)
    if len(round_s) != len(degrees) or not round_s:
        raise ValueError("round_s and degrees must be non-empty and of equal length")
    h, u = local_steps, workload.update_time
    per, waits, exposed = [], [], []
    for g, k in zip(round_s, degrees):
        if g < 0:
            raise ValueError(f"round times must be >= 0, got {g!r}")
        wait = _period_compute(workload, h, k + 1)
        waits.append(wait / h)
        per.append((max(wait, g) + h * u) / h)
        exposed.append(max(0.0, g - wait) / h)
    mean = sum(per) / len(per)
    return Prediction(
        f"{name} H={h}",
        mean,
        sum(waits) / len(waits),
        sum(round_s) / len(round_s) / h,
        sum(exposed) / len(exposed),
        {"rounds": per, "update": u, "local_steps": h},
    )


def predict_diloco(
    workload: Workload, world_size: int, allreduce_s: float, local_steps: int
) -> Prediction:
    """DiLoCo: ``local_steps`` local iterations, then a blocking all-reduce over every worker."""
    _check(local_steps)
    if allreduce_s < 0:
        raise ValueError(f"allreduce_s must be >= 0, got {allreduce_s!r}")
    h = local_steps
    compute = _period_compute(workload, h, max(world_size, 1)) / h
    comm = allreduce_s / h
    return Prediction(
        f"diloco H={h}",
        compute + comm + workload.update_time,
        compute,
        comm,
        comm,
        {"update": workload.update_time, "local_steps": h},
    )

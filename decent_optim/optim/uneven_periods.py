r"""Periods for uneven ranks: a rank slower than the mean launches its rounds after fewer steps.

In :mod:`~decent_optim.optim.uneven` a rank mixes a round once it has arrived and it has taken
its period of steps since launching it. With a period of :math:`H` steps on every rank, a
period lasts as long as the slowest rank needs for its :math:`H`: with one rank at a quarter
speed, every other rank takes :math:`4H` steps between mixes, and drifts as far. With
``Uneven(adaptive=True)`` (the default) a rank that took :math:`c_i` steps between launching
rounds :math:`k-1` and :math:`k`, where the ranks took :math:`\bar c = (S_k - S_{k-1}) / n` on
average (:math:`S_k`: their summed step counts at launching round :math:`k`), takes

.. math::
    m_i = \min\left(H, \max\left(1, \left\lfloor H c_i / \bar c + \tfrac12 \right\rfloor\right)\right)

steps before it launches a round, from the launch after it mixed round :math:`k` on. A period
then lasts about :math:`H` steps of an average rank instead of :math:`H` of the slowest: at a
quarter speed the slow rank takes one step per period and the others about four. Every number
comes from the rounds' sums, so where the rounds arrive as before the periods are as before;
on even hardware every :math:`c_i = \bar c = H`, so :math:`m_i = H`.
"""

from __future__ import annotations

__all__ = ["next_period"]


def next_period(local_steps: int, summed: float, world_size: int, own: int) -> int:
    """:math:`m_i` of the module docstring: ``summed`` = :math:`S_k - S_{k-1}`, ``own`` =
    :math:`c_i`; ``local_steps`` when there is nothing to compare with."""
    mean = summed / world_size
    if own <= 0 or not mean > 0:
        return local_steps
    return min(local_steps, max(1, int(local_steps * own / mean + 0.5)))

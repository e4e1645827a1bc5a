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

With local steps (gossip every :math:`H` steps, and DiLoCo's all-reduce every :math:`H`) see
:mod:`decent_optim.runtime.local_steps`; on workers of uneven speed (and ``uneven=True``), see
:mod:`decent_optim.runtime.uneven`.

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
  workers, traffic inside a node moves at ``intra_bw`` per worker; groups with several ranks on
  each of several nodes average by node (one copy per direction over each uplink), other groups
  of three or more by a ring all-reduce (about ``2 (k-1)/k`` messages per worker), pairs by one
  send and one receive each (what :class:`~decent_optim.gossip.Gossiper` does). With
  ``compression`` the groups across nodes send :func:`wire_bytes` instead of float copies.
"""

from __future__ import annotations

from decent_optim.runtime.links import (
    WIRE_BYTES,
    allreduce_time,
    gossip_round_times,
    parse_rate,
    wire_bytes,
)
from decent_optim.runtime.local_steps import predict_diloco, predict_local_steps
from decent_optim.runtime.model import (
    Prediction,
    Workload,
    expected_max_normal,
    predict_allreduce,
    predict_gossip,
    recommend,
    round_degrees,
)
from decent_optim.runtime.uneven import check_speeds, paced, predict_uneven

__all__ = [
    "WIRE_BYTES",
    "Prediction",
    "Workload",
    "allreduce_time",
    "check_speeds",
    "expected_max_normal",
    "gossip_round_times",
    "paced",
    "parse_rate",
    "predict_allreduce",
    "predict_diloco",
    "predict_gossip",
    "predict_local_steps",
    "predict_uneven",
    "recommend",
    "round_degrees",
    "wire_bytes",
]

"""The gossip layer: the one package that talks to :mod:`torch.distributed`.

``Gossiper.start(buffers, step)`` launches round ``step`` of the topology asynchronously and
returns a :class:`GossipHandle`; ``handle.wait_and_mix_()`` finishes the exchange and overwrites
each buffer with ``sum_j W(step)[rank, j] * buffer_j``. Between the two calls the caller may read
the buffers (forward and backward) but must not write them: they are sent as they are, without
a copy. An optimizer calls ``handle.wait_and_mix_unscaled_()`` instead: a round whose weights are
all equal (a pair: 1/2) then leaves the plain sum ``sum_j buffer_j`` in the buffer, one pass, and
hands the factor back for the caller to apply -- usually folded into its own update, so that
mixing and updating cost one pass over the buffer less.

Each round is carried out by an exchange strategy (:mod:`decent_optim.gossip.exchange`), chosen
per round of the topology's period:

* **pairs and arbitrary weights -> point-to-point** (:mod:`~decent_optim.gossip.p2p`): each
  rank sends its buffer to every rank that mixes it in and receives one buffer per in-neighbour;
  for a pair this moves one buffer each way and needs no copy of the parameters.
* **uniform groups of three or more -> all-reduce on a sub-group** of a copy of the buffer
  (:mod:`~decent_optim.gossip.allreduce`); a periodic global average is the same strategy on the
  whole group.

Why this split: measured with ``benchmarks/gossip_transport.py`` on 4 CPU ranks with gloo
(median time per round; 1 / 16 / 64 MB buffers): for pairs, point-to-point took 0.56-0.82x the
time of a two-rank all-reduce (ring 16 MB: 32 ms vs 44 ms); for a group of four (``complete``),
all-reduce took 0.55-0.62x the time of three point-to-point exchanges per rank (16 MB: 46 ms vs
83 ms). Pass ``transport="p2p"`` or ``"allreduce"`` to :class:`Gossiper` to force one.

Module map: :mod:`~decent_optim.gossip.handle` (a round in flight, its deadline),
:mod:`~decent_optim.gossip.failures` (what a failed wait raises: dead peer, timeout, late ranks),
:mod:`~decent_optim.gossip.exchange` (the strategy interface and the shared receive buffers),
:mod:`~decent_optim.gossip.gossiper` (the choice per round), :mod:`~decent_optim.gossip.collectives`
(start-up collectives and measurements), :mod:`~decent_optim.gossip.averager` (a torch
``ModelAverager`` that gossips, for ``PostLocalSGDOptimizer``),
:mod:`~decent_optim.gossip.arrival` (which ranks never reached a collective),
:mod:`~decent_optim.gossip.dcp_guard` (refuses a ``torch.distributed.checkpoint`` save that
spans several replicas of a sharded model), :mod:`~decent_optim.gossip.elastic` (refuses a
torchrun set-up whose restarts would hang).
"""

from decent_optim.gossip.arrival import Arrival
from decent_optim.gossip.averager import GossipAverager
from decent_optim.gossip.collectives import (
    broadcast_,
    channel,
    check_devices,
    comm_device,
    gather_ints,
    gather_objects,
    group_ranks,
    resolve_group,
)
from decent_optim.gossip.elastic import check_restarts
from decent_optim.gossip.failures import GossipError
from decent_optim.gossip.gossiper import TRANSPORTS, Gossiper, LocalGossiper
from decent_optim.gossip.handle import GossipHandle, PendingMix

__all__ = [
    "TRANSPORTS",
    "Arrival",
    "GossipAverager",
    "GossipError",
    "GossipHandle",
    "Gossiper",
    "LocalGossiper",
    "PendingMix",
    "broadcast_",
    "channel",
    "check_devices",
    "check_restarts",
    "comm_device",
    "gather_ints",
    "group_ranks",
    "gather_objects",
    "resolve_group",
]

r"""Gossip instead of a global average for torch's local SGD: :class:`GossipAverager`.

torch's ``PostLocalSGDOptimizer(optim, averager)`` steps any torch optimizer locally and then
calls ``averager.average_parameters(param_groups)``; with ``PeriodicModelAverager`` that is an
all-reduce of the whole model every ``period`` steps. :class:`GossipAverager` is a drop-in
``ModelAverager`` that instead mixes with the topology's neighbours of that round,
:math:`x_i \leftarrow \sum_j W^{(r)}_{ij} x_j`, where ``r`` counts the averaging rounds. It waits
for the exchange (as torch's averager waits for its all-reduce); for the exchange overlapped with
the next forward and backward, use a decent_optim optimizer instead of the pair.

The parameters to average are chosen as torch chooses them (those with a gradient), copied into
one flat buffer per dtype and device, exchanged, and copied back, so the model's tensors stay
its own.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.algorithms.model_averaging.averagers import ModelAverager
from torch.distributed.algorithms.model_averaging.utils import get_params_to_average

from decent_optim import topologies
from decent_optim._validation import check_timeout, resolve_local_world_size
from decent_optim.gossip.collectives import resolve_group
from decent_optim.gossip.elastic import check_restarts
from decent_optim.gossip.gossiper import Gossiper
from decent_optim.topologies import Topology

__all__ = ["GossipAverager"]


class GossipAverager(ModelAverager):
    """A ``ModelAverager`` that gossips with the topology's neighbours every ``period`` steps.

    Args:
        period: average every this many calls of :meth:`average_parameters` (steps).
        warmup_steps: no averaging during the first this many steps (torch's meaning).
        topology: a topology name or a :class:`~decent_optim.Topology`, as for the optimizers.
        process_group: the ranks that gossip (default: the world).
        local_world_size: ranks per node, for node-aware topologies (default from torchrun).
        timeout: seconds to wait for a round before raising
            :class:`~decent_optim.gossip.GossipError`.

    Built on every rank at the same point (it may create sub-groups). ``step`` counts calls,
    as torch's averagers do; ``PostLocalSGDOptimizer`` saves and restores it, and with it the
    position in the topology's schedule.
    """

    def __init__(
        self,
        period: int = 1,
        warmup_steps: int = 0,
        *,
        topology: str | Topology = "ring",
        process_group: Any = None,
        local_world_size: int | None = None,
        timeout: float | datetime.timedelta | None = None,
    ) -> None:
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"period must be a positive int, got {period!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be a non-negative int, got {warmup_steps!r}")
        group, world_size = resolve_group(process_group)
        if group is None:
            raise RuntimeError(
                "GossipAverager needs torch.distributed: call dist.init_process_group(...) first"
            )
        check_restarts()  # torchrun's restarts of this job would hang
        super().__init__(group)
        self.period, self.warmup_steps = period, warmup_steps
        topo = topologies.get(topology, world_size, resolve_local_world_size(local_world_size))
        self.gossiper = Gossiper(topo, group, timeout=check_timeout(timeout))
        self.topology = topo

    def average_parameters(self, params: Iterable[Any]) -> None:
        """One step: mix ``params`` (tensors or param groups) with the round's neighbours when due."""
        due = self.step >= self.warmup_steps and (self.step - self.warmup_steps) % self.period == 0
        if due:
            self._mix(get_params_to_average(params), (self.step - self.warmup_steps) // self.period)
        self.step += 1

    @torch.no_grad()
    def _mix(self, params: list[Tensor], round: int) -> None:
        groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for p in params:
            groups.setdefault((p.device, p.dtype), []).append(p)
        members = list(groups.values())
        buffers = [torch.cat([p.detach().reshape(-1) for p in ps]) for ps in members]
        self.gossiper.start(buffers, round).wait_and_mix_()
        for ps, buf in zip(members, buffers):
            for p, part in zip(ps, buf.split([p.numel() for p in ps])):
                p.copy_(part.view_as(p))

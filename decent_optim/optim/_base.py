"""What every decentralized optimizer shares: buckets, start-up, gossip timing, state layout.

A subclass supplies only its hyper-parameter checks, the names of its per-parameter state
buffers and the call of its kernel (:meth:`DecentralizedOptimizer._update`).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from decent_optim import topologies
from decent_optim._validation import check_decentralized, resolve_local_world_size
from decent_optim.flat import Bucket, FlatParams, check_flattenable
from decent_optim.gossip import Gossiper, GossipHandle, LocalGossiper
from decent_optim.topologies import Topology

__all__ = ["DecentralizedOptimizer"]


class DecentralizedOptimizer(Optimizer):
    r"""Base class: a torch optimizer whose parameters are also gossiped with neighbours.

    Each :meth:`step` does, on rank :math:`i` at round :math:`t` (``t`` = completed steps):

    1. wait for the round-``t`` exchange launched by the previous step and mix,
       :math:`x_i \leftarrow \sum_j W^{(t)}_{ij} x_j`;
    2. apply the local update (the subclass's kernel) to the mixed parameters with the
       gradient computed at the unmixed ones;
    3. launch round ``t + 1`` with the new parameters, to travel during the next forward and
       backward.

    Round 0 would mix the identical start values broadcast from rank 0, so the first step has
    nothing to wait for. Every rank launches exactly one round per step, whatever happens
    locally, because its neighbours are waiting for it.
    """

    #: names of the per-parameter state tensors kept in flat buffers, per param group
    _flat_state_keys: Callable[[dict[str, Any]], tuple[str, ...]]

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        topology: str | Topology,
        process_group: Any,
        bucket_cap_mb: float,
        local_world_size: int | None,
    ) -> None:
        check_decentralized(topology, bucket_cap_mb, local_world_size)
        self._building = True
        super().__init__(params, defaults)
        self._building = False
        all_params = [p for g in self.param_groups for p in g["params"]]
        for p in all_params:
            check_flattenable(p)

        group, world_size = _resolve_group(process_group)
        self.topology = topologies.get(
            topology, world_size, resolve_local_world_size(local_world_size)
        )
        if world_size > 1:
            device = _comm_device(group, all_params)
            _check_same_parameters(all_params, group, device)  # collective, before any change
        self._flat = FlatParams([g["params"] for g in self.param_groups], bucket_cap_mb)
        if world_size > 1:
            src = dist.get_global_rank(group, 0)
            for buf in self._flat.buffers:
                dist.broadcast(buf, src=src, group=group)  # every rank starts from rank 0's x(0)
            self._gossip: Gossiper | LocalGossiper = Gossiper(self.topology, group)
        else:
            self._gossip = LocalGossiper(self.topology)
        self._pending: GossipHandle | None = None
        self._rounds = 0  # completed steps; the next step waits on round `_rounds`
        self._flat_state: dict[tuple[int, str], list[Tensor]] = {}

    # -- public -------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This worker's rank in the optimizer's process group (0 without one)."""
        return self._gossip.rank

    @property
    def world_size(self) -> int:
        """Number of workers gossiping (1 without a process group)."""
        return self._gossip.world_size

    def synchronize(self) -> None:
        """Wait for the gossip in flight and mix it into the parameters.

        Afterwards the parameters are final for the current step: what the next :meth:`step`
        would have mixed in is already in. Cheap when nothing is in flight.
        """
        handle, self._pending = self._pending, None
        if handle is not None:
            handle.wait_and_mix_()

    def __del__(self) -> None:
        # Finish a round still in flight before its buffers and handles go away: gloo aborts
        # the transfers of a destroyed work object, and the peers' sends to us would then time
        # out. The peers launched the same round, so this returns promptly; a dead peer makes
        # the wait fail, which must not escape a destructor.
        try:
            self.synchronize()
        except Exception:
            pass

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Mix the neighbours' parameters in, take the local update, send the result on.

        Args:
            closure: re-evaluates the model and returns the loss, as for torch.optim.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.is_sparse:
                    raise RuntimeError(
                        f"{type(self).__name__} does not support sparse gradients; use dense "
                        "gradients (e.g. nn.Embedding(sparse=False))"
                    )
        self._flat.check_aliasing()
        self.synchronize()
        for index, bucket in enumerate(self._flat.buckets):
            group = self.param_groups[bucket.group_index]
            with_grad = [k for k, p in enumerate(bucket.params) if p.grad is not None]
            if with_grad:
                self._update(group, self._bucket_state(index, bucket, group, with_grad))
        self._rounds += 1
        # launch even when no parameter had a gradient: the neighbours wait on this round
        self._pending = self._gossip.start(self._flat.buffers, self._rounds)
        return loss

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not getattr(self, "_building", False):
            raise RuntimeError(
                f"{type(self).__name__} cannot add parameter groups after construction: its "
                "parameters live in flat buffers shared with the peers. Pass every group to the "
                "constructor (a group with lr=0 can wait for its turn)"
            )
        super().add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's format plus ``"decent_optim": {"step": rounds}``."""
        return {**super().state_dict(), "decent_optim": {"step": self._rounds}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch.optim-format state; the round counter comes from the ``decent_optim`` entry.

        Without that entry (a torch.optim checkpoint) the counter is taken from the largest
        per-parameter ``step`` in the state, or 0, which every rank loading the same file agrees on.
        """
        self.synchronize()
        state_dict = dict(state_dict)
        extra = state_dict.pop("decent_optim", None)
        super().load_state_dict(state_dict)
        if extra is not None:
            self._rounds = int(extra["step"])
        else:
            steps = [float(s["step"]) for s in self.state.values() if "step" in s]
            self._rounds = int(max(steps, default=0))
        self._refill_flat_state()

    # -- for subclasses ------------------------------------------------------------------------
    def _update(self, group: dict[str, Any], state: _BucketState) -> None:
        raise NotImplementedError

    def _init_state(self, group: dict[str, Any], state: dict[str, Any], p: Tensor) -> None:
        """Per-parameter state beside the flat buffers (e.g. a ``step`` counter); default none."""

    # -- internals ------------------------------------------------------------------------------
    def _flat_views(self, index: int, bucket: Bucket, key: str) -> list[Tensor]:
        views = self._flat_state.get((index, key))
        if views is None:
            views = bucket.views(torch.zeros_like(bucket.data))
            self._flat_state[(index, key)] = views
        return views

    def _bucket_state(
        self, index: int, bucket: Bucket, group: dict[str, Any], with_grad: list[int]
    ) -> _BucketState:
        keys = self._flat_state_keys(group)
        views = {key: self._flat_views(index, bucket, key) for key in keys}
        params = [bucket.params[k] for k in with_grad]
        states, fresh = [], []
        for k, p in zip(with_grad, params):
            st = self.state[p]
            fresh.append(not st)
            if not st:
                for key in keys:
                    st[key] = views[key][k]
                self._init_state(group, st, p)
            states.append(st)
        grads = [p.grad for p in params]  # with_grad lists only parameters whose grad is set
        return _BucketState(params, grads, states, fresh)  # type: ignore[arg-type]

    def _refill_flat_state(self) -> None:
        """After torch's loader made new state tensors, copy them into the flat buffers."""
        for index, bucket in enumerate(self._flat.buckets):
            keys = self._flat_state_keys(self.param_groups[bucket.group_index])
            for k, p in enumerate(bucket.params):
                st = self.state.get(p)
                if not st:
                    continue
                for key in keys:
                    if key in st and isinstance(st[key], Tensor):
                        view = self._flat_views(index, bucket, key)[k]
                        view.copy_(st[key])
                        st[key] = view


class _BucketState:
    """The parameters of one bucket that have gradients, with their grads and state dicts.

    ``fresh[k]`` is True when parameter ``k``'s state was created by this step.
    """

    __slots__ = ("fresh", "grads", "params", "states")

    def __init__(
        self,
        params: list[Tensor],
        grads: list[Tensor],
        states: list[dict[str, Any]],
        fresh: list[bool],
    ) -> None:
        self.params, self.grads, self.states, self.fresh = params, grads, states, fresh

    def get(self, key: str) -> list[Tensor]:
        return [st[key] for st in self.states]

    def split(self, keep: list[bool]) -> _BucketState:
        """The sub-list of parameters whose ``keep`` entry is True."""
        pick = [k for k, yes in enumerate(keep) if yes]
        return _BucketState(
            [self.params[k] for k in pick],
            [self.grads[k] for k in pick],
            [self.states[k] for k in pick],
            [self.fresh[k] for k in pick],
        )


def _resolve_group(process_group: Any) -> tuple[Any, int]:
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise RuntimeError(
                "process_group was given but torch.distributed is not initialised; call "
                "dist.init_process_group(...) first"
            )
        return None, 1
    group = process_group if process_group is not None else dist.group.WORLD
    return group, dist.get_world_size(group)


def _comm_device(group: Any, params: list[Tensor]) -> torch.device:
    backend = dist.get_backend(group)
    devices = {p.device.type for p in params}
    if backend == "nccl":
        if devices - {"cuda"}:
            raise ValueError(
                f"the NCCL backend exchanges CUDA tensors only, but parameters are on {sorted(devices)}; "
                "move the model to the GPU before building the optimizer, or use gloo"
            )
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo" and devices - {"cpu"}:
        raise ValueError(
            f"the gloo backend sends CPU tensors only, but parameters are on {sorted(devices)}; "
            "use the NCCL backend for GPU training"
        )
    return torch.device("cpu")


def _check_same_parameters(params: list[Tensor], group: Any, device: torch.device) -> None:
    """All-gather a fingerprint of the parameter shapes and dtypes; raise on any difference."""
    desc = ";".join(f"{tuple(p.shape)}:{p.dtype}" for p in params)
    mine = torch.tensor(
        [len(params), sum(p.numel() for p in params), zlib.crc32(desc.encode())],
        dtype=torch.int64,
        device=device,
    )
    world = dist.get_world_size(group)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    rows = [tuple(int(v) for v in t.tolist()) for t in everyone]
    differ = [r for r in range(world) if rows[r] != rows[0]]
    if differ:
        detail = ", ".join(
            f"rank {r}: {rows[r][0]} tensors / {rows[r][1]} elements" for r in [0, *differ]
        )
        raise ValueError(
            "the parameters differ across ranks (shapes or dtypes); every rank must build the same "
            f"model before the optimizer. {detail}"
            + (
                ""
                if len({r[:2] for r in rows}) > 1
                else " (same sizes, different shapes or dtypes)"
            )
        )

"""What every decentralized optimizer shares: buckets, start-up, gossip timing, state layout.

A subclass supplies only its hyper-parameter checks, the names of its per-parameter state
buffers and the call of its kernel (:meth:`DecentralizedOptimizer._update`).
"""

from __future__ import annotations

import contextlib
import datetime
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
from torch import Tensor
from torch.optim import Optimizer

from decent_optim import topologies
from decent_optim._validation import (
    check_decentralized,
    check_global_avg_every,
    check_timeout,
    resolve_local_world_size,
)
from decent_optim.flat import Bucket, FlatParams, check_flattenable
from decent_optim.gossip import (
    Gossiper,
    GossipHandle,
    LocalGossiper,
    broadcast_,
    check_same_parameters,
    comm_device,
    resolve_group,
)
from decent_optim.optim._fast import FastBucket
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

    Steps 1 and 2 share a pass over the memory where they can: a round of equal weights (a
    pair's 1/2) leaves the sum :math:`\sum_j x_j` in the buffer, and the update applies the
    weight as part of its kernel (see :meth:`_update_bucket_fast`; the general path multiplies
    first). After the first step a bucket whose parameters all have gradients is updated by
    cached whole-bucket kernel calls, without per-parameter Python work.

    Round 0 would mix the identical start values broadcast from rank 0, so the first step has
    nothing to wait for. Every rank launches exactly one round per step, whatever happens
    locally (parameters without gradients, an update a ``GradScaler`` skipped), because its
    neighbours are waiting for it.

    Parameters with ``requires_grad=False`` when the optimizer is built (frozen layers) are
    broadcast from rank 0 once and then left out of the gossip: they never change, so there is
    nothing to average, and no bandwidth is spent on them (a gradient on one later is an error).
    Trainable parameters that get no gradient in a step (an unused branch) skip their local
    update, as in torch.optim, but are still gossiped. Their values are equal on every rank, so
    a pair's mean keeps them exactly; the floating-point mean of three or more equal values
    (``complete``, the groups of ``alternating-exp-ring``) can differ in the last bit.

    Checkpoints: :meth:`state_dict` is torch.optim's format plus a ``"decent_optim"`` entry with
    the round counter and whether a round was in flight. A round in flight is not waited for:
    the model's parameters hold the rank's unmixed values, and the first :meth:`step` after
    :meth:`load_state_dict` runs that round again (all ranks resume together, so their sends
    match) before it mixes, which reproduces the uninterrupted run bit for bit.
    """

    #: names of the per-parameter state tensors kept in flat buffers, per param group
    _flat_state_keys: Callable[[dict[str, Any]], tuple[str, ...]]

    # GradScaler calls step() even when it found inf/NaN, passing ``grad_scale`` and
    # ``found_inf`` as attributes: the update is then skipped but the gossip round still runs
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        topology: str | Topology,
        process_group: Any,
        bucket_cap_mb: float,
        local_world_size: int | None,
        timeout: float | datetime.timedelta | None,
        global_avg_every: int | None,
    ) -> None:
        check_decentralized(topology, bucket_cap_mb, local_world_size)
        wait_limit = check_timeout(timeout)
        check_global_avg_every(global_avg_every)
        self._building = True
        super().__init__(params, defaults)
        self._building = False
        all_params = [p for g in self.param_groups for p in g["params"]]
        for p in all_params:
            check_flattenable(p)

        group, world_size = resolve_group(process_group)
        self.topology = topologies.get(
            topology, world_size, resolve_local_world_size(local_world_size)
        )
        if world_size > 1:
            device = comm_device(group, all_params)
            check_same_parameters(all_params, group, device)  # collective, before any change
        trainable = [[p for p in g["params"] if p.requires_grad] for g in self.param_groups]
        self._frozen = [p for p in all_params if not p.requires_grad]
        self._flat = FlatParams(trainable, bucket_cap_mb)
        self._stash: list[Tensor] | None = None
        if world_size > 1:
            own = [b.clone() for b in self._flat.buffers]
            broadcast_(self._flat.buffers, group)  # every rank starts from rank 0's x(0)
            broadcast_([p.detach() for p in self._frozen], group)
            if any(not torch.equal(a, b) for a, b in zip(own, self._flat.buffers)):
                # this rank had its own weights (a resume that loaded the model first): keep
                # them until load_state_dict can put them back, or the first step drops them
                self._stash = own
                self._stash_print = _fingerprint(self._flat.buffers)
            self._gossip: Gossiper | LocalGossiper = Gossiper(
                self.topology, group, timeout=wait_limit
            )
        else:
            self._gossip = LocalGossiper(self.topology)
        self._global_avg_every = global_avg_every
        self._pending: GossipHandle | None = None
        self._relaunch = False  # a loaded checkpoint had round `_rounds` in flight
        self._rounds = 0  # completed steps; the next step waits on round `_rounds`
        self._flat_state: dict[tuple[int, str], tuple[Tensor, list[Tensor]]] = {}
        self._fast: dict[int, FastBucket] = {}  # bucket index -> its cached fast-path lists

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
        self._launch_resumed_round()
        handle, self._pending = self._pending, None
        if handle is not None:
            handle.wait_and_mix_()

    @contextlib.contextmanager
    def averaged(self, module: torch.nn.Module | None = None) -> Iterator[None]:
        """Within the block, every rank's parameters are the global average; restored on exit.

        A collective: every rank enters it at the same point. The round in flight is waited
        for (its values are kept to be mixed by the next :meth:`step`), the parameters are
        replaced by their mean over all ranks and, when ``module`` is given, so are its
        floating-point buffers (e.g. BatchNorm running statistics). On exit every value is
        restored bit for bit, so training continues as if the block never ran.

        Example:
            >>> with opt.averaged(model):  # doctest: +SKIP
            ...     val_loss = evaluate(model)
        """
        if self._pending is not None:
            self._pending.wait()  # its sends read the buffers we are about to overwrite
        tensors = list(self._flat.buffers)
        if module is not None:
            tensors += [b for b in module.buffers() if b.is_floating_point()]
        backup = [t.detach().clone() for t in tensors]
        try:
            with torch.no_grad():
                self._gossip.average_([t.detach() for t in tensors])
            yield
        finally:
            with torch.no_grad():
                for t, saved in zip(tensors, backup):
                    t.copy_(saved)

    def consensus_distance(self) -> float:
        r"""This rank's distance to the mean parameters, :math:`\lVert x_i - \bar x \rVert_2`.

        A collective (every rank calls it; each gets its own distance), over every gossiped
        parameter, in float64. Uses the current, unmixed values, like the paper's d2c.
        """
        if self._pending is not None:
            self._pending.wait()
        values = [b.double() for b in self._flat.buffers]  # float64 copies: an exact-ish mean
        mean = [v.clone() for v in values]
        self._gossip.average_(mean)
        return math.sqrt(sum(float(torch.sub(v, m).square().sum()) for v, m in zip(values, mean)))

    def consensus_state_dict(self, module: torch.nn.Module) -> dict[str, Tensor]:
        """``module.state_dict()`` of the globally averaged model, for export or deployment.

        A collective; every rank gets the same copy (save it from rank 0). The rank's own
        values are untouched. Example: ``sd = opt.consensus_state_dict(model)``, then on rank 0
        ``torch.save(sd, "model.pt")``.
        """
        with self.averaged(module):
            return {k: v.detach().clone() for k, v in module.state_dict().items()}

    def __del__(self) -> None:
        # Finish a round still in flight before its buffers and handles go away: gloo aborts
        # the transfers of a destroyed work object, and the peers' sends to us would then time
        # out. The peers launched the same round, so this returns promptly; a dead peer makes
        # the wait fail, which must not escape a destructor.
        try:
            if self._pending is not None:
                self._pending.wait()
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
        grads = self._check_step_inputs()
        self._stash = None  # training has begun from the broadcast values
        self._launch_resumed_round()
        handle, self._pending = self._pending, None
        # the mix, except for a factor per bucket that the update applies (see _update_bucket_fast)
        factors = handle.wait_and_mix_unscaled_() if handle is not None else None
        grad_scale = getattr(self, "grad_scale", None)  # set by GradScaler.step
        found_inf = getattr(self, "found_inf", None)
        # the fast path caches Python lists, so tracing (torch.compile) takes the general one
        fast = grad_scale is None and found_inf is None and not torch.compiler.is_compiling()
        for index, bucket in enumerate(self._flat.buckets):
            group = self.param_groups[bucket.group_index]
            factor = 1.0 if factors is None else factors[index]
            bucket_grads = grads[index]
            if fast and all(g is not None for g in bucket_grads):
                cached = self._fast_bucket(index, bucket, group)
                if cached is not None and self._update_bucket_fast(
                    cached, cast(list[Tensor], bucket_grads), factor
                ):
                    continue
            # the general path may leave the state in a shape the cached lists do not expect
            # (e.g. parameters at different steps): rebuild them when the fast path next runs
            self._fast.pop(index, None)
            if factor != 1.0:
                bucket.data.mul_(factor)  # finish the mix first, also for params without grads
            with_grad = [k for k, g in enumerate(bucket_grads) if g is not None]
            if with_grad:
                state = self._bucket_state(index, bucket, group, with_grad)
                self._update(group, state, grad_scale=grad_scale, found_inf=found_inf)
        self._rounds += 1
        # launch even when no parameter had a gradient: the neighbours wait on this round
        self._pending = self._start_round()
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
        """torch.optim's format plus ``"decent_optim": {"step": rounds, "pending": in_flight}``.

        Does not wait for the round in flight; see the class docstring for how it is resumed.
        """
        pending = self._pending is not None or self._relaunch
        return {**super().state_dict(), "decent_optim": {"step": self._rounds, "pending": pending}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch.optim-format state; the round counter comes from the ``decent_optim`` entry.

        Without that entry (a torch.optim checkpoint, e.g. from DDP training) the counter is the
        largest per-parameter ``step`` in the state, or 0, which every rank loading the same
        file agrees on, and no round is in flight. Works in both orders of resuming: build the
        optimizer, then load model and optimizer state; or load the model's (per-rank) weights,
        build the optimizer, then load its state -- the start-up broadcast does not overwrite
        the weights being resumed.
        """
        if self._pending is not None:
            self._pending.discard()  # the round of the old trajectory: finish it, drop it
            self._pending = None
        self._fast.clear()  # the cached lists point at the state being replaced
        state_dict = dict(state_dict)
        extra = state_dict.pop("decent_optim", None)
        super().load_state_dict(state_dict)
        if extra is not None:
            self._rounds = int(extra["step"])
            self._relaunch = bool(extra.get("pending", False))
        else:
            steps = [float(s["step"]) for s in self.state.values() if "step" in s]
            self._rounds = int(max(steps, default=0))
            self._relaunch = False
        self._refill_flat_state()
        stash, self._stash = self._stash, None
        if stash is not None and _fingerprint(self._flat.buffers) == self._stash_print:
            # the model was loaded before the optimizer was built: put this rank's weights back
            with torch.no_grad():
                for buf, own in zip(self._flat.buffers, stash):
                    buf.copy_(own)

    # -- for subclasses ------------------------------------------------------------------------
    def _update(
        self,
        group: dict[str, Any],
        state: _BucketState,
        *,
        grad_scale: Tensor | None,
        found_inf: Tensor | None,
    ) -> None:
        raise NotImplementedError

    def _update_bucket_fast(self, fast: FastBucket, grads: list[Tensor], factor: float) -> bool:
        """Optional fast path for a whole bucket; True when it did the bucket's update.

        Called only when every parameter of the bucket has a gradient (``grads``), outside
        ``GradScaler`` and tracing, and once the bucket's state is ready for ``fast`` (built as
        the class attributes ``_fast_*`` say). The bucket holds the mixed parameters divided by
        ``factor`` (see :meth:`GossipHandle.mix_unscaled_
        <decent_optim.gossip.GossipHandle.mix_unscaled_>`): a fast path that returns True must
        have applied it (:meth:`FastBucket.take_factor`). One that returns False must not have
        changed anything; the general path then applies the factor and updates the bucket.
        """
        return False

    #: how :meth:`_fast_bucket` builds a bucket's cache: with one shared step counter (on the
    #: bucket's device, or on ``_fast_step_device``), and on the flat buffers for small tensors
    _fast_counted = False
    _fast_step_device: torch.device | None = None
    _fast_flatten = True

    def _fast_bucket(self, index: int, bucket: Bucket, group: dict[str, Any]) -> FastBucket | None:
        """The cached :class:`FastBucket` of bucket ``index``, built on first use; None while
        the state is not ready for it (see :meth:`FastBucket.build`)."""
        fast = self._fast.get(index)
        if fast is None or fast.key != self._flat_state_keys(group):
            fast = FastBucket.build(
                self, index, bucket, group, counted=self._fast_counted,
                step_device=self._fast_step_device, flatten=self._fast_flatten,
            )  # fmt: skip
            if fast is None:
                return None
            self._fast[index] = fast
        return fast

    def _init_state(self, group: dict[str, Any], state: dict[str, Any], p: Tensor) -> None:
        """Per-parameter state beside the flat buffers (e.g. a ``step`` counter); default none."""

    def _after_load(self, state: dict[str, Any], p: Tensor) -> None:
        """Adjust one parameter's state after :meth:`load_state_dict`; default nothing."""

    # -- internals ------------------------------------------------------------------------------
    def _start_round(self) -> GossipHandle | None:
        every = self._global_avg_every
        global_average = bool(every) and self._rounds % every == 0  # type: ignore[operator]
        handle = self._gossip.start(self._flat.buffers, self._rounds, global_average=global_average)
        return None if handle.is_noop else handle

    def _launch_resumed_round(self) -> None:
        if self._relaunch:
            self._relaunch = False
            self._pending = self._start_round()

    def _check_step_inputs(self) -> list[list[Tensor | None]]:
        """Each bucket's gradients (None where a parameter has none), once they passed the checks."""
        grads = [[p.grad for p in b.params] for b in self._flat.buckets]
        present = [g for bucket in grads for g in bucket if g is not None]
        if any(g.is_sparse for g in present):
            raise RuntimeError(
                f"{type(self).__name__} does not support sparse gradients; use dense "
                "gradients (e.g. nn.Embedding(sparse=False))"
            )
        for p in self._frozen:
            if p.grad is not None:
                raise RuntimeError(
                    f"a parameter of shape {tuple(p.shape)} had requires_grad=False when "
                    f"{type(self).__name__} was built, so it is not gossiped, but it now has a "
                    "gradient; unfreeze parameters before building the optimizer"
                )
        if not present and self._rounds == 0 and not self.state:
            raise RuntimeError(
                "step() was called before any backward(): no parameter has a gradient. Call "
                "loss.backward() first (every rank must then call step() once per iteration)"
            )
        self._flat.check_aliasing()
        return grads

    def _flat_buffer(self, index: int, bucket: Bucket, key: str) -> tuple[Tensor, list[Tensor]]:
        """State ``key`` of bucket ``index``: one flat buffer and its per-parameter views."""
        entry = self._flat_state.get((index, key))
        if entry is None:
            flat = torch.zeros_like(bucket.data)
            entry = self._flat_state[(index, key)] = (flat, bucket.views(flat))
        return entry

    def _flat_views(self, index: int, bucket: Bucket, key: str) -> list[Tensor]:
        return self._flat_buffer(index, bucket, key)[1]

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
        grads = [p.grad for p in params if p.grad is not None]  # all, by choice of with_grad
        return _BucketState(params, grads, states, fresh)

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
                self._after_load(st, p)


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


def _fingerprint(buffers: list[Tensor]) -> list[tuple[float, float]]:
    """Cheap summary of the values (sum and 2-norm in float64), to notice a change."""
    return [
        (float(b.sum(dtype=torch.float64)), float(torch.linalg.vector_norm(b, dtype=torch.float64)))
        for b in buffers
    ]

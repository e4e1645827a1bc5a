r"""The engine every decentralized optimizer shares: gossip rounds around an update rule.

A public optimizer class is its hyper-parameters plus an :class:`~decent_optim.rules.base.UpdateRule`;
this class does everything else, in parts of their own: start-up (:mod:`~decent_optim.optim.startup`),
the rounds (:mod:`~decent_optim.optim.rounds`), the state in flat buffers
(:mod:`~decent_optim.optim.state`) and checkpoints (:mod:`~decent_optim.optim.checkpoint`).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch.optim import Optimizer

from decent_optim._validation import (
    check_decentralized,
    check_global_avg_every,
    check_timeout,
    check_unsupported,
)
from decent_optim.optim import frameworks, joining, live, live_owner, schedules, stepping
from decent_optim.optim.consensus import ConsensusViews
from decent_optim.optim.facts import Budgeted, WorkerFacts
from decent_optim.optim.failure import FailureLatch, guarded
from decent_optim.optim.inputs import AveragedCheck
from decent_optim.optim.local_steps import Periods
from decent_optim.optim.options import ParamsT, with_defaults
from decent_optim.optim.outer import LocalOuterSGD, OuterSGD
from decent_optim.optim.state import FlatState
from decent_optim.optim.state_dicts import StateDicts
from decent_optim.rules.base import UpdateRule
from decent_optim.topologies import Topology

if TYPE_CHECKING:
    from decent_optim.gossip.codec_base import Codec
    from decent_optim.gossip.membership import Membership as LiveMembership
    from decent_optim.gossip.membership import View

__all__ = ["DecentralizedOptimizer"]


class DecentralizedOptimizer(Budgeted, ConsensusViews, StateDicts, WorkerFacts, Optimizer):
    r"""Base class: a torch optimizer whose parameters are also gossiped with neighbours.

    Each :meth:`step` does, on rank :math:`i` at round :math:`t` (``t`` = completed steps):

    1. wait for the round-``t`` exchange launched by the previous step and mix,
       :math:`x_i \leftarrow \sum_j W^{(t)}_{ij} x_j`;
    2. apply the local update (the class's update rule) to the mixed parameters with the
       gradient computed at the unmixed ones;
    3. launch round ``t + 1`` with the new parameters, to travel during the next forward and
       backward.

    Steps 1 and 2 share passes over memory where they can: after a pair round the rule gets the
    rank's values, the peer's and the weight 1/2, and applies them in its own update (see
    :mod:`decent_optim.rules.base`). Every rank launches exactly one round per step, whatever
    happens locally (parameters without gradients, an update a ``GradScaler`` skipped), because
    its neighbours are waiting for it.

    Parameters with ``requires_grad=False`` when the optimizer is built (frozen layers) are
    broadcast from rank 0 once and then left out of the gossip: they never change, so there is
    nothing to average, and no bandwidth is spent on them (a gradient on one later is an error).
    Trainable parameters that get no gradient in a step (an unused branch) skip their local
    update, as in torch.optim, but are still gossiped. Their values are equal on every rank, so
    a pair's mean keeps them exactly; the floating-point mean of three or more equal values
    (``complete``, the groups of ``alternating-exp-ring``) can differ in the last bit.

    ``opt.state[p]`` holds views of flat state buffers; what is written through it is copied in
    before the next update (:mod:`decent_optim.optim.state`). Building one is a collective that
    checks the ranks agree (:mod:`decent_optim.optim.startup`).

    Args:
        params: parameters or param groups, as for torch.optim.
        defaults: the algorithm's hyper-parameters (a subclass passes them), or a function that
            checks and returns them: it runs where an error reaches every rank.
        topology: a name (``"complete"``, ``"ring"``, ``"one-peer-exp"``,
            ``"alternating-exp-ring"``) or a :class:`~decent_optim.Topology`.
        process_group: the workers that gossip (default: the world group): a
            ``ProcessGroup``, or a 1-D ``DeviceMesh`` (``mesh["replicate"]`` for parameters
            sharded with FSDP2 on ``mesh["shard"]``; see :doc:`/large_models`).
        bucket_cap_mb: size of the flat buckets parameters are packed into.
        local_world_size: workers per node (default: ``LOCAL_WORLD_SIZE`` from torchrun, else
            1; for sharded parameters, the members of the gossip group on this rank's node).
        timeout: seconds (or a ``timedelta``) to wait for a gossip round before raising
            :class:`~decent_optim.gossip.GossipError` naming the round and the peers; default:
            the process group's timeout.
        global_avg_every: also average globally (all-reduce) every this many steps, instead of
            that step's gossip round (Gossip-PGA); default never.
        maximize: maximize the objective instead of minimizing it, as in torch.optim.
        foreach: accepted for compatibility with torch.optim; the update picks its kernels.
        capturable, differentiable: torch.optim flags this package does not implement; they
            must stay False.
        fused: for updates that have no single torch kernel (AccumAdam's), whether to compile
            one with ``torch.compile`` (see :mod:`decent_optim.rules.compiled`): None (default)
            for buckets of at least 2**20 elements, True for every bucket, False never. The
            other updates always run torch's fused kernels.
        compression: None (default) sends exact parameters. ``"bf16"`` or ``"int8"`` (a scale
            per 1024 values) compresses what crosses between nodes, as differences against
            public copies with error feedback (CHOCO-gossip): errors do not accumulate and every
            round keeps the mean. Sparse and low-bit codecs (``"int4"``, ``"int2"``,
            ``"rand1%"``, ``"top1%+int2"``, ...) or a codec object: see
            :func:`decent_optim.gossip.codecs.get`. Needs rounds that average uniform groups (every named
            topology) and memory for the copies; see :doc:`/algorithms` ("Compressed gossip").
        local_steps: gossip every this many steps instead of every step (default 1). The round
            launched at the end of a period of ``local_steps`` steps travels during the whole
            next period and is mixed in at its end; one extra parameter-sized buffer. Another
            cadence of periods: a :class:`~decent_optim.optim.local_steps.Periods` subclass.
        outer: None (default), a :class:`~decent_optim.LocalOuterSGD` (recommended with
            ``local_steps``: every ``every`` steps an outer Nesterov step on each rank's own
            slow weights, with no round of its own, so no waiting; two more buffers), or
            ``"diloco"``/an :class:`~decent_optim.OuterSGD` (at the end of every period an outer
            step on the anchors, whose round is waited for; one more buffer). See
            :doc:`/algorithms` ("Local steps"). With ``uneven=True`` only a
            :class:`~decent_optim.LocalOuterSGD`, its ``every`` then counting DDP-equivalent
            steps (any ``every``, not only multiples of ``local_steps``).
        uneven: with ``local_steps``, for workers of uneven speed: a period lasts at least
            ``local_steps`` steps and until the neighbours' round has arrived, and the faster
            workers take more steps meanwhile instead of waiting, at most ``cap`` times
            ``local_steps`` (``True`` is ``decent_optim.Uneven(cap=8)``). Call :meth:`stop_at`
            before the first step and end the loop on :attr:`stopped` (a loop of
            ``for step in range(N)`` is refused at its first step); see :doc:`/uneven_hardware`. With
            ``outer=LocalOuterSGD(...)`` every rank takes the outer step at the same round, the
            first whose DDP-equivalent progress crosses a multiple of ``every``.
        membership: a :class:`~decent_optim.gossip.membership.Membership` (live membership):
            when a worker dies, the others' :meth:`step` returns and they train on in a
            rebuilt group; see :mod:`decent_optim.optim.live` for what is kept and supported.
            ``Membership(store, join=True)`` in a process outside the group joins the running
            job: construction blocks until it holds a member's state
            (:mod:`decent_optim.optim.joining`).
        on_membership_change: with ``membership``, called as ``fn(view)`` after each change
            (a :class:`~decent_optim.gossip.membership.View`), e.g. to reshard the data.
    """

    #: the algorithm: its state, its update
    rule: ClassVar[UpdateRule]

    # GradScaler calls step() even when it found inf/NaN, passing ``grad_scale`` and
    # ``found_inf`` as attributes: the update is then skipped but the gossip round still runs
    _step_supports_amp_scaling = True

    def __init_subclass__(cls, **defaults: Any) -> None:
        """``class B(A, weight_decay=1e-2)``: B is A whose constructor has other defaults."""
        super().__init_subclass__()
        if defaults:
            parent_init = cls.__mro__[1].__init__  # type: ignore[misc]
            cls.__init__ = with_defaults(parent_init, f"{cls.__qualname__}.__init__", defaults)  # type: ignore[method-assign]

    def __init__(
        self,
        params: ParamsT,
        defaults: dict[str, Any] | Callable[[], dict[str, Any]],
        *,
        topology: str | Topology = "ring",
        process_group: Any = None,
        bucket_cap_mb: float = 25,
        local_world_size: int | None = None,
        timeout: float | datetime.timedelta | None = None,
        global_avg_every: int | None = None,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        compression: str | Codec | None = None,
        local_steps: int | Periods = 1,
        outer: OuterSGD | LocalOuterSGD | str | None = None,
        uneven: bool | schedules.Uneven = False,
        membership: LiveMembership | None = None,
        on_membership_change: Callable[[View], object] | None = None,
    ) -> None:
        failure = None
        period = schedules.EVERY_STEP
        self._building = True
        self._latch = FailureLatch(type(self).__name__)
        try:  # a rank that fails alone must tell the others, which would wait for it at start-up
            check_unsupported(
                type(self).__name__, capturable=capturable, differentiable=differentiable
            )
            check_decentralized(topology, bucket_cap_mb, local_world_size, compression)
            wait_limit = check_timeout(timeout)
            check_global_avg_every(global_avg_every)
            period = schedules.check(local_steps, outer, global_avg_every, uneven)
            live.check(membership, on_membership_change, topology, process_group)
            live_owner.check(membership, type(self).__name__)  # one per process
            flags = dict(maximize=maximize, foreach=foreach, fused=fused)
            flags.update(capturable=False, differentiable=False)
            hyper = defaults() if callable(defaults) else defaults
            super().__init__(params, {**hyper, **{k: flags[k] for k in self.rule.flags}})
        except Exception as err:
            failure, wait_limit, self.param_groups = err, None, []
        self._building = False
        start = joining.starter(membership)(
            [g["params"] for g in self.param_groups],
            [g.get("param_names") for g in self.param_groups],
            name=type(self).__name__,
            failure=failure,
            topology=topology,
            process_group=process_group,
            bucket_cap_mb=bucket_cap_mb,
            local_world_size=local_world_size,
            timeout=wait_limit,
            global_avg_every=global_avg_every,
            compression=compression,
            local_steps=period.describe(),
            deferred=period.uneven is not None,
        )
        self.topology, self._member = start.topology, start.member
        self._where = (start.group, start.device)  # of load_state_dict's cross-check
        self._flat, self._frozen, self._stash = start.flat, start.frozen, start.stash
        # what a newcomer must have alike (joining.fit)
        self._schedule, self._global_avg_every = period, global_avg_every
        self._rounds = schedules.make_rounds(start.gossip, start.flat, global_avg_every, period)
        live_owner.take(self, start.gossip, membership)  # and bounds its waits
        self._rounds.live = live.attach(
            self, start, membership, on_membership_change, topology, compression
        )
        self._flat_state = FlatState(start.flat.buckets, self.rule)
        self.state = self._flat_state.wrap(self.state)
        self._flat_state.prefill(self.state, self.param_groups)  # sharded only: see there
        self._group_params = [list(g["params"]) for g in self.param_groups]
        self._averaged = AveragedCheck()
        frameworks.check_strategy(type(self).__name__, self.world_size)  # Lightning's, if any
        joining.finish(self, start)

    # -- public -------------------------------------------------------------------------------
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
        # under torch.compile only the update rule is traced (see decent_optim.optim.stepping)
        work = self._prepare(torch.compiler.is_compiling())
        for _, batch, group, mix, amp in work:
            self.rule.update(batch, group, mix=mix, amp=amp)
        self._conclude(work)
        return loss

    @torch._dynamo.disable  # type: ignore[misc]
    @guarded
    def _prepare(self, traced: bool) -> list[stepping.Work]:
        """Everything a step does before the rule (:func:`~decent_optim.optim.stepping.prepare`)."""
        return stepping.prepare(self, traced)

    @torch._dynamo.disable  # type: ignore[misc]
    @guarded
    def _conclude(self, work: list[stepping.Work]) -> None:
        """Everything a step does after the rule (:func:`~decent_optim.optim.stepping.conclude`)."""
        stepping.conclude(self, work)

    @guarded
    def synchronize(self) -> None:
        """Wait for the gossip in flight and mix it into the parameters.

        Afterwards the parameters are final for the current step: what the next :meth:`step`
        would have mixed in is already in. Cheap when nothing is in flight. Call it before
        writing parameters in place between steps (weight clipping, ``p.copy_``): a write while
        the round is in flight raises at the next step (:mod:`decent_optim.optim.rounds`).
        """
        self._readopt()
        self._rounds.synchronize()
        self._flat.publish()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not getattr(self, "_building", False):
            raise RuntimeError(
                f"{type(self).__name__} cannot add parameter groups after construction: its "
                "parameters live in flat buffers shared with the peers. Pass every group to the "
                "constructor (a group with lr=0 can wait for its turn)"
            )
        super().add_param_group(param_group)

    def _readopt(self) -> None:
        """Take back parameters moved with ``.to()`` or given new ``.data`` (see :mod:`~decent_optim.flat`)."""
        self._rounds.readopt(type(self).__name__)

    def __del__(self) -> None:
        # Finish a round still in flight before its buffers and handles go away: gloo aborts
        # the transfers of a destroyed work object, and the peers' sends to us would then time
        # out. The peers launched the same round, so this returns promptly; a dead peer makes
        # the wait fail, which must not escape a destructor.
        try:
            if self._latch.failure is None:  # after a failure the peers are gone or out of step
                self._rounds.wait()
        except Exception:
            pass

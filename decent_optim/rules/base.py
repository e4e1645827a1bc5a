r"""The contract between the engine and an algorithm's update rule, and what every rule shares.

An update rule is one algorithm's local step and nothing else: no process groups, no buckets to
build, no checkpoints. The engine (:class:`~decent_optim.DecentralizedOptimizer`) owns those and
drives the rule through three things:

* :meth:`UpdateRule.keys`: the state tensors the rule keeps per parameter of a param group,
  besides the ``step`` counter when :attr:`UpdateRule.counts_steps`. The engine stores each as a
  flat buffer per bucket (:mod:`decent_optim.flat`); every one starts at zero, and the engine
  copies loaded or hand-replaced state into those buffers, so a rule never repairs state.
* :meth:`UpdateRule.update`: one step of the tensors in a :class:`Batch` -- a whole bucket (its
  flat buffer, or its per-parameter views) or the views of the parameters that have gradients --
  with the round's :class:`~decent_optim.gossip.PendingMix` still to apply and the
  ``GradScaler`` values (:class:`Amp`). The same ``update`` serves every path.
* :attr:`UpdateRule.flags`: the torch.optim flags the class keeps in its param groups.

**Folding the mix into the update.** After a pair round a bucket holds :math:`x_i + x_j` and the
factor :math:`c = 1/2` is still to apply (:class:`~decent_optim.gossip.PendingMix`). A kernel
whose first operation on the parameter is :math:`p \leftarrow (1 - \eta w) p` -- AdamW's
decoupled decay, or SGD's L2 decay when there is no momentum, since then
:math:`p - \eta (g + w p) = (1 - \eta w) p - \eta g` -- computes the same step on :math:`p / c`
when it is given the decay :math:`w'` with

.. math::
    1 - \eta w' = c\,(1 - \eta w), \qquad w' = \frac{1 - c\,(1 - \eta w)}{\eta},

so the factor costs no pass of its own. The result differs from multiplying first by a few units
in the last place. :func:`folded_decay` is the one place this identity is computed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from decent_optim.flat import Bucket
from decent_optim.gossip.handle import PendingMix

__all__ = ["Amp", "Batch", "UpdateRule", "finish_mix", "folded_decay"]


class Amp(NamedTuple):
    """What ``GradScaler.step`` hands the optimizer: gradients are ``grad_scale`` times too large,
    and a nonzero ``found_inf`` means the update must be skipped (the gossip still runs)."""

    grad_scale: Tensor | None = None
    found_inf: Tensor | None = None

    @property
    def active(self) -> bool:
        return self.grad_scale is not None or self.found_inf is not None


@dataclass
class Batch:
    """The tensors one call of :meth:`UpdateRule.update` steps, all of one device and dtype.

    Attributes:
        bucket: the bucket they belong to.
        params, grads: ``[bucket.data]`` and one flat gradient (``flat``), or per-parameter views
            and their gradients.
        state: per state key, the tensors laid out like ``params``.
        steps: one step counter per entry of ``params`` (0-d views of the bucket's counters; for
            a flat batch the first counter stands for all, which are then equal).
        counters: the bucket's whole counter vector when the batch covers the bucket, else None.
        step: the step count of every parameter before this update, when they are equal and
            known on the host; else None.
        fresh: per entry of ``params``, whether its state starts with this update.
        whole: the batch covers every parameter of its bucket.
        flat: ``params`` is the single flat buffer of the whole bucket.
    """

    bucket: Bucket
    params: list[Tensor]
    grads: list[Tensor]
    state: dict[str, list[Tensor]]
    steps: list[Tensor]
    counters: Tensor | None
    step: int | None
    fresh: list[bool]
    whole: bool
    flat: bool

    def advance_steps(self) -> None:
        """Count this update in every step counter of the batch."""
        if self.counters is not None:
            self.counters.add_(1)
        elif self.steps:
            torch._foreach_add_(self.steps, 1)

    def uncount_skipped(self, found_inf: Tensor | None) -> None:
        """Take back the count of an update that ``GradScaler`` skipped (``found_inf`` nonzero)."""
        if found_inf is None:
            return
        if self.counters is not None:
            self.counters.sub_(found_inf)
        elif self.steps:
            torch._foreach_sub_(self.steps, [found_inf] * len(self.steps))

    def split(self, keep: list[bool]) -> Batch:
        """The entries whose ``keep`` flag is set, as a batch that no longer covers the bucket."""
        pick = [k for k, yes in enumerate(keep) if yes]
        return Batch(
            bucket=self.bucket,
            params=[self.params[k] for k in pick],
            grads=[self.grads[k] for k in pick],
            state={key: [views[k] for k in pick] for key, views in self.state.items()},
            steps=[self.steps[k] for k in pick] if self.steps else [],
            counters=None,
            step=self.step,
            fresh=[self.fresh[k] for k in pick],
            whole=False,
            flat=False,
        )


class UpdateRule(ABC):
    """One algorithm's local update, as the engine drives it (see the module docstring)."""

    #: whether the rule keeps a ``step`` counter per parameter (in ``opt.state[p]["step"]``)
    counts_steps: bool = True
    #: the torch.optim flags the class keeps in its param groups (all take their torch defaults)
    flags: tuple[str, ...] = ("maximize", "foreach", "capturable", "differentiable", "fused")

    @abstractmethod
    def keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        """Names of the per-parameter state tensors for ``group``'s hyper-parameters."""

    def flatten(self, bucket: Bucket, group: dict[str, Any]) -> bool:
        """Whether a whole-bucket update wants the gradients copied into one flat buffer.

        Default: on CPUs, for buckets of small tensors. torch's fused kernels cost tens of
        microseconds per tensor there on top of the memory traffic; below 2**16 elements per
        tensor on average, copying the gradients into one buffer and calling the kernel once on
        the whole bucket is faster. GPUs batch tensors in one launch, so there the kernels run on
        the per-parameter lists.
        """
        return bucket.device.type == "cpu" and bucket.numel < (1 << 16) * len(bucket.params)

    @abstractmethod
    def update(self, batch: Batch, group: dict[str, Any], *, mix: PendingMix, amp: Amp) -> None:
        """One step of ``batch``; applies ``mix`` first or folds it into the step.

        ``mix`` is not empty only for a batch that covers its whole bucket. Skip the update (and
        count nothing) where ``amp.found_inf`` is nonzero.
        """


#: the smallest learning rate the factor is folded at: the folded decay is about ``1 / (2 lr)``,
#: which must stay a finite float32 (the kernels compute in float32 for float32 and narrower
#: parameters), with ``lr`` itself a normal float32 so that ``lr * w'`` keeps its precision
FOLD_MIN_LR = float(torch.finfo(torch.float32).tiny)


def can_fold(lr: Any) -> bool:
    """True when ``lr`` allows folding a pending mix factor into the decay.

    A tensor learning rate would need a device-to-host read per step to compute the folded
    decay, ``lr == 0`` has no decay to fold into, and below :data:`FOLD_MIN_LR` the folded
    decay overflows float32 (``ExponentialLR(0.5)`` gets there in 126 steps); all three take
    the explicit multiplication, which stays finite wherever torch.optim's step does.
    """
    return isinstance(lr, (float, int)) and not isinstance(lr, bool) and lr >= FOLD_MIN_LR


def folded_decay(factor: float, lr: float, weight_decay: float) -> float:
    """The decay :math:`w'` that makes a decaying kernel apply ``factor`` too (module docstring)."""
    return (1.0 - factor * (1.0 - lr * weight_decay)) / lr


def finish_mix(
    batch: Batch, mix: PendingMix, *, lr: Any, weight_decay: float, foldable: bool
) -> tuple[float, bool]:
    """Apply the round's pending mix to the batch's bucket before a decaying kernel runs.

    The addend (a peer's values) is added now; the factor is folded into the decay where the
    kernel starts with :math:`p \\leftarrow (1 - \\eta w) p` (``foldable``) and ``lr`` allows it,
    else multiplied now. Returns ``(decay for the kernel, whether the factor was folded)``;
    a folded decay must be applied as decoupled decay.
    """
    data = batch.bucket.data
    if mix.addend is not None:
        data.add_(mix.addend)
    if mix.factor == 1.0:
        return weight_decay, False
    if foldable and can_fold(lr):
        return folded_decay(mix.factor, lr, weight_decay), True
    data.mul_(mix.factor)
    return weight_decay, False

r"""What a round carries: the parameters themselves (:class:`InPlace`), or the anchors (:class:`Anchors`).

Every-step gossip sends the parameters' own storage, without a copy, and the mix is fused with
the update (:class:`InPlace`). Writing a parameter in place before the round is taken (weight
clipping after ``step()``) would race with the send: the neighbours would receive some old and
some new values, and differently in every run. So the parameters' version counters (which torch
bumps on every in-place write through the tensor or a view of it, ``p.detach()`` included) are
read when a round is launched and compared when it is taken; a difference raises, and
``synchronize()`` first is the way to write between steps. Writes through ``p.data`` bypass those
counters, but ``p.data = t`` gives the parameter new memory, which
:meth:`Rounds.readopt <decent_optim.optim.rounds.Rounds.readopt>` notices: it settles the round
(whose memory was not written) and then takes ``t``.

Local steps send the *anchors* :math:`a_i` (what the rank last sent; with DiLoCo its outer
parameters), and the mix adds its change to the working parameters, :math:`x_i \leftarrow x_i
+ \sum_j w_{ij} a_j - a_i` (:class:`Anchors`; the math is in
:mod:`~decent_optim.optim.local_steps`). The parameters never travel, so they may be written at
any time; the anchor is written by no one while its round travels.
"""

from __future__ import annotations

import torch
from torch import Tensor

from decent_optim.flat import FlatParams
from decent_optim.gossip import GossipHandle, PendingMix
from decent_optim.optim.outer import PeriodEnd

__all__ = ["Anchors", "InPlace"]


class InPlace:
    """The parameters travel in place; their versions guard against writes while they do."""

    anchored = False  # (checkpoints keep nothing of it: the parameters are saved anyway)

    def __init__(self, flat: FlatParams) -> None:
        self._flat = flat
        self._params = [p for b in flat.buckets for p in b.params]
        self._versions: list[int] | None = None  # of the parameters when the round was launched

    def buffers(self) -> list[Tensor]:
        """What a round sends."""
        return self._flat.buffers

    def begin(self) -> None:
        """At each step before the mix (:class:`Anchors`: take them at the first)."""

    def seal(self, end: PeriodEnd) -> None:
        """At a period's end, before its round is launched (:class:`Anchors`: the end's step)."""

    def mix(self, handle: GossipHandle, deferred: bool) -> list[PendingMix] | None:
        """Mix ``handle``'s round in; ``deferred``: leave per bucket what the update fuses."""
        if deferred:
            return handle.wait_and_mix_deferred_()
        handle.wait_and_mix_()
        return None

    def record(self, pending: GossipHandle | None) -> None:
        """Remember the parameters' versions: they must not change while a round is in flight."""
        sending = pending is not None and not torch.compiler.is_compiling()
        self._versions = [p._version for p in self._params] if sending else None

    def clear(self) -> None:
        """The round is taken or dropped: writes are safe until the next launch."""
        self._versions = None

    def check(self, count: int) -> None:
        """Raise if a parameter was written in place while round ``count`` was sending it."""
        if self._versions is None:
            return
        now = [p._version for p in self._params]
        if now != self._versions:
            written = [p for p, a, b in zip(self._params, now, self._versions) if a != b]
            self._versions = None  # said once; the caller decides what to do
            raise RuntimeError(
                f"{len(written)} parameter(s) (the first of shape {tuple(written[0].shape)}) "
                f"were written in place after step() while gossip round {count} was "
                "still sending them (e.g. weight clipping, p.copy_(...), "
                "model.load_state_dict(...)); the neighbours may have received half-written "
                "values. Call opt.synchronize() before writing parameters between steps: it "
                "finishes the round, and the next step() sends the written values"
            )

    def fits(self, owner: str) -> None:
        """Parameters moved (``.to()``) travel from where they are now."""

    def saved(self) -> dict[str, list[Tensor] | None]:
        return {}

    def load(self, key: str, flats: list[Tensor]) -> None:
        raise KeyError(key)

    def reset(self) -> None:
        self._versions = None


class Anchors:
    """The anchors travel (module docstring): taken from the parameters at the first step (the
    model may still be loaded between building the optimizer and stepping)."""

    anchored = True

    def __init__(self, flat: FlatParams) -> None:
        self._flat = flat
        self.anchor: list[Tensor] | None = None

    def buffers(self) -> list[Tensor]:
        assert self.anchor is not None  # begin() ran first
        return self.anchor

    def begin(self) -> None:
        if self.anchor is None:
            self.anchor = [b.clone() for b in self._flat.buffers]

    def seal(self, end: PeriodEnd) -> None:
        """The period end's step on the anchor (the parameters, DiLoCo's outer step)."""
        assert self.anchor is not None
        end.anchor_step(self._flat.buffers, self.anchor)

    def mix(self, handle: GossipHandle, deferred: bool) -> None:
        assert self.anchor is not None
        with torch.no_grad():
            # x - a is the local progress of the period; the mixed anchor gets it back
            for x, a in zip(self._flat.buffers, self.anchor):
                x.sub_(a)
            handle.wait_and_mix_()
            for x, a in zip(self._flat.buffers, self.anchor):
                x.add_(a)

    def record(self, pending: GossipHandle | None) -> None:
        """Nothing to guard: the parameters never travel, the anchors are written by no one."""

    def clear(self) -> None:
        pass

    def check(self, count: int) -> None:
        pass

    def fits(self, owner: str) -> None:
        """The anchors stay where they are: parameters moved after the first step cannot follow."""
        if self.anchor is not None:
            for a, x in zip(self.anchor, self._flat.buffers):
                if (a.device, a.dtype) != (x.device, x.dtype):
                    raise RuntimeError(
                        f"{owner} with local_steps: parameters moved to {x.device} / {x.dtype} "
                        f"after the first step, but the outer parameters are on {a.device} / "
                        f"{a.dtype}. Move the model before building the optimizer, or save a "
                        "checkpoint and build a new optimizer after moving"
                    )

    def saved(self) -> dict[str, list[Tensor] | None]:
        return {"anchor": self.anchor}

    def load(self, key: str, flats: list[Tensor]) -> None:
        assert key == "anchor", key
        self.anchor = flats

    def reset(self) -> None:
        """A resume: the anchors come from the checkpoint, else from the parameters."""
        self.anchor = None

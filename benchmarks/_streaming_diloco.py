r"""Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512), the paper's recipe, for the benchmark.

DiLoCo (``_diloco.py``) with three changes. **Fragments**: the model's layers are dealt to
``F`` fragments in turn (layer :math:`i` to fragment :math:`i \bmod F`, the paper's "strided"
pattern), and fragment :math:`f` is synchronised every ``H`` steps, after steps
:math:`o_f + kH` with :math:`o_f = \lfloor (f + 1) H / F \rfloor`, so the fragments' exchanges
are staggered by :math:`H / F` steps (with ``F = 1``: after every ``H``-th step, as DiLoCo).
**Overlap**: fragment :math:`f`'s outer gradient :math:`\Delta_f = \theta_f - x_f` (the
fragment's outer parameters less this worker's) is averaged over the workers by an exchange
launched at step :math:`s` and waited for ``tau`` inner steps later, at step :math:`s + \tau`,
the worker training on meanwhile. There the outer Nesterov SGD step (torch.optim.SGD's, as
``_diloco.py``: lr 0.7, momentum 0.9) gives the new :math:`\theta_f` from the mean
:math:`\bar\Delta_f`, and the worker's fragment is **merged** with it:

.. math::
    x_f \leftarrow \alpha\, x_f + (1 - \alpha)\, \theta_f,

keeping part of the :math:`\tau` steps it took while the exchange was in flight (``alpha = 0``:
they are dropped; the paper's recommendation is 0.5). **Quantised exchange** (``bits=4`` or
``8``): each worker's :math:`\Delta_f` is quantised before it is sent and the mean is formed in
fp32 from the received values. The exchange is a two-phase all-reduce: every worker quantises
its :math:`\Delta_f` and sends the ``r``-th of ``n`` shards to rank ``r`` (all-to-all); rank
``r`` dequantises the ``n`` copies of its shard, sums them in fp32 in rank order, divides by
``n``, quantises the mean and all-gathers it. Every value crosses the wire twice at ``bits``
bits, so per sync a worker sends and receives :math:`2 (n - 1)/n` copies at ``bits / 32`` the
fp32 size, plus one fp32 scale per 64 values. The format is symmetric integers with a
per-chunk scale (``absmax / (2^{bits-1} - 1)`` for every 64 values, round to nearest, no error
feedback); the paper's 4-bit format is E3M0 floats, which this does not emulate.

With ``F = 1``, ``tau = 0``, ``alpha = 0`` and no quantisation this is ``_diloco.DiLoCo``, bit
for bit. Exchanges run in order on one background thread over a process group of their own, so
that the training loop's own collectives (DDP-style evaluation, barriers) never interleave with
them. Every rank must call ``step``, ``averaged`` and ``close`` at the same points.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from _diloco import averaged_parameters
from torch.nn.utils import parameters_to_vector

CHUNK = 64  # values per quantisation scale


def quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric ``bits``-bit integer codes of ``x`` (length a multiple of ``CHUNK``) and the
    fp32 scale of every chunk: ``x ~ codes * scale``."""
    top = 2 ** (bits - 1) - 1
    chunks = x.float().view(-1, CHUNK)
    scale = chunks.abs().amax(dim=1) / top
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(chunks / scale[:, None]).clamp_(-top, top).to(torch.int8)
    return codes.view(-1), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (codes.view(-1, CHUNK).float() * scale[:, None]).view(-1)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The bytes sent: int8 codes as they are, 4-bit codes two per byte."""
    if bits == 8:
        return codes.view(torch.uint8)
    nibbles = (codes + 8).to(torch.uint8).view(-1, 2)
    return nibbles[:, 0] | (nibbles[:, 1] << 4)


def unpack(data: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return data.view(torch.int8)
    low, high = data & 15, data >> 4
    return torch.stack([low, high], dim=1).view(-1).to(torch.int8) - 8


class StreamingDiLoCo:
    """Wraps an inner optimizer over ``layers`` (lists of parameters, in model order):
    ``step()`` is its step plus the fragments' sends and merges due at this step."""

    def __init__(
        self,
        layers: Sequence[Iterable[torch.Tensor]],
        inner: torch.optim.Optimizer,
        local_steps: int,
        fragments: int = 1,
        delay: int = 0,
        alpha: float = 0.0,
        lr: float = 0.7,
        momentum: float = 0.9,
        nesterov: bool = True,
        bits: int | None = None,
    ) -> None:
        layers = [list(layer) for layer in layers]
        if not 1 <= fragments <= min(local_steps, len(layers)):
            raise ValueError(
                f"fragments must be between 1 and min(local_steps={local_steps}, "
                f"{len(layers)} layers), got {fragments}"
            )
        if not 0 <= delay < local_steps:
            raise ValueError(f"delay (tau) must be in [0, local_steps), got {delay}")
        if not 0 <= alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if bits not in (None, 4, 8):
            raise ValueError(f"bits must be None, 4 or 8, got {bits}")
        self.inner, self.local_steps, self.delay, self.alpha = inner, local_steps, delay, alpha
        self.lr, self.momentum, self.nesterov, self.bits = lr, momentum, nesterov, bits
        self.params = [p for layer in layers for p in layer]
        self.fragments = [
            [p for i, layer in enumerate(layers) if i % fragments == f for p in layer]
            for f in range(fragments)
        ]
        self.offsets = [(f + 1) * local_steps // fragments for f in range(fragments)]
        self.theta = [parameters_to_vector(frag).detach().clone() for frag in self.fragments]
        self.momentum_buffers: list[torch.Tensor | None] = [None] * fragments
        self.pending: dict[int, tuple[int, Future[torch.Tensor]]] = {}
        self.steps = 0
        self.group = dist.new_group(backend="gloo")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sdiloco")

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def sends_at(self, fragment: int, step: int) -> bool:
        """Whether ``fragment``'s outer gradient is sent after inner step ``step`` (1-based)."""
        offset = self.offsets[fragment]
        return step >= offset and (step - offset) % self.local_steps == 0

    @torch.no_grad()
    def step(self) -> None:
        self.inner.step()
        self.steps += 1
        for f, frag in enumerate(self.fragments):
            if self.sends_at(f, self.steps):
                delta = self.theta[f] - parameters_to_vector(frag)
                self.pending[f] = (self.steps + self.delay, self._pool.submit(self._mean, delta))
        for f in sorted(self.pending):
            due, future = self.pending[f]
            if due == self.steps:
                del self.pending[f]
                self._outer_step(f, future.result())

    def _mean(self, delta: torch.Tensor) -> torch.Tensor:
        """The workers' mean of ``delta`` (on the exchange thread)."""
        if self.bits is None:
            dist.all_reduce(delta, group=self.group)
            return delta.div_(dist.get_world_size(self.group))
        return self._quantized_mean(delta)

    def _quantized_mean(self, delta: torch.Tensor) -> torch.Tensor:
        n, bits = dist.get_world_size(self.group), self.bits
        assert bits is not None
        shard = -(-delta.numel() // (n * CHUNK)) * CHUNK
        padded = torch.zeros(n * shard, dtype=torch.float32)
        padded[: delta.numel()] = delta
        codes, scale = quantize(padded, bits)
        data, their_scales = pack(codes, bits), torch.empty_like(scale)
        theirs = torch.empty_like(data)
        dist.all_to_all_single(theirs, data, group=self.group)
        dist.all_to_all_single(their_scales, scale, group=self.group)
        mine = dequantize(unpack(theirs, bits), their_scales).view(n, shard).sum(dim=0) / n
        codes, scale = quantize(mine, bits)
        data = pack(codes, bits)
        all_data = [torch.empty_like(data) for _ in range(n)]
        all_scales = [torch.empty_like(scale) for _ in range(n)]
        dist.all_gather(all_data, data, group=self.group)
        dist.all_gather(all_scales, scale, group=self.group)
        full = dequantize(unpack(torch.cat(all_data), bits), torch.cat(all_scales))
        return full[: delta.numel()].to(delta.dtype)

    def _outer_step(self, f: int, delta: torch.Tensor) -> None:
        """Fragment ``f``'s outer step on the mean outer gradient, then the merge."""
        buf = self.momentum_buffers[f]
        if buf is None:
            buf = self.momentum_buffers[f] = delta.clone()
        else:
            buf.mul_(self.momentum).add_(delta)
        update = delta.add_(buf, alpha=self.momentum) if self.nesterov else buf
        self.theta[f].sub_(update, alpha=self.lr)
        start = 0
        for p in self.fragments[f]:
            new = self.theta[f][start : start + p.numel()].view_as(p)
            if self.alpha == 0:
                p.copy_(new)  # (a copy: vector_to_parameters would alias theta)
            else:
                p.mul_(self.alpha).add_(new, alpha=1 - self.alpha)
            start += p.numel()

    def close(self) -> None:
        """Wait for the exchanges in flight (all ranks must call it) and stop the thread."""
        for _, future in self.pending.values():
            future.result()
        self.pending.clear()
        self._pool.shutdown(wait=True)

    def averaged(self) -> AbstractContextManager[None]:
        """Within the block the parameters are the workers' mean; restored on exit."""
        return averaged_parameters(self.params)

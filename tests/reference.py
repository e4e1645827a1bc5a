"""Dense single-process references, written from ``shared/design/algorithms.md`` alone.

The ``n`` workers' flattened parameters are the rows of one float64 matrix ``X``; a step is
``X <- U(W(t) @ X, G)``, with ``G`` the gradients at the unmixed ``X`` and ``U`` the textbook
update written out element by element below -- no torch.optim, no decent_optim kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class Segment:
    """A slice ``[start, stop)`` of the flat parameter vector with its hyper-parameters."""

    start: int
    stop: int
    hyper: dict


@dataclass
class RefState:
    """Per-worker optimizer state, one row per worker, one column per parameter element."""

    tensors: dict[str, Tensor] = field(default_factory=dict)
    steps: int = 0

    def get(self, name: str, like: Tensor) -> Tensor:
        if name not in self.tensors:
            self.tensors[name] = torch.zeros_like(like)
        return self.tensors[name]


def sgd(
    x: Tensor,
    g: Tensor,
    st: RefState,
    *,
    lr,
    momentum=0.0,
    dampening=0.0,
    weight_decay=0.0,
    nesterov=False,
    maximize=False,
) -> Tensor:
    g = -g if maximize else g
    g = g + weight_decay * x
    if momentum:
        if "buf" not in st.tensors:
            st.tensors["buf"] = g.clone()
        else:
            st.tensors["buf"] = momentum * st.tensors["buf"] + (1 - dampening) * g
        buf = st.tensors["buf"]
        g = g + momentum * buf if nesterov else buf
    return x - lr * g


def _decay(x: Tensor, g: Tensor, lr, weight_decay, decoupled, maximize) -> tuple[Tensor, Tensor]:
    """Adam's and AccumAdam's first step: negate for ``maximize``, then decoupled decay shrinks
    ``x`` (AdamW) or L2 decay adds ``weight_decay * x`` to the gradient (Adam)."""
    g = -g if maximize else g
    if decoupled:
        return x * (1 - lr * weight_decay), g
    return x, g + weight_decay * x


def adam(
    x: Tensor,
    g: Tensor,
    st: RefState,
    *,
    lr,
    betas=(0.9, 0.999),
    eps=1e-8,
    weight_decay=0.0,
    decoupled=False,
    amsgrad=False,
    maximize=False,
) -> Tensor:
    b1, b2 = betas
    x, g = _decay(x, g, lr, weight_decay, decoupled, maximize)
    t = st.steps
    m = st.tensors["m"] = b1 * st.get("m", x) + (1 - b1) * g
    v = st.tensors["v"] = b2 * st.get("v", x) + (1 - b2) * g * g
    if amsgrad:
        v = st.tensors["vmax"] = torch.maximum(st.get("vmax", x), v)
    m_hat = m / (1 - b1**t)
    return x - lr * m_hat / (torch.sqrt(v) / math.sqrt(1 - b2**t) + eps)


def accum_adam(
    x: Tensor,
    g: Tensor,
    st: RefState,
    *,
    lr,
    accum_iter,
    betas=(0.9, 0.999),
    eps=1e-8,
    weight_decay=0.0,
    decoupled=False,
    amsgrad=False,
    maximize=False,
) -> Tensor:
    b1, b2 = betas
    x, g = _decay(x, g, lr, weight_decay, decoupled, maximize)
    t, s = st.steps, accum_iter
    mbar, vbar = st.get("mbar", x), st.get("vbar", x)
    m = b1 * mbar + (1 - b1) * g
    v = b2 * vbar + (1 - b2) * g * g
    if amsgrad:  # as in Adam: the denominator uses the largest second moment seen so far
        v = st.tensors["vmax"] = torch.maximum(st.get("vmax", x), v)
    k = -(-t // s)  # ceil(t / s)
    new_x = x - lr * (m / (1 - b1**k)) / (torch.sqrt(v / (1 - b2**k)) + eps)
    acc = st.tensors["acc"] = st.get("acc", x) + g / s
    if t % s == 0:
        st.tensors["mbar"] = b1 * mbar + (1 - b1) * acc
        st.tensors["vbar"] = b2 * vbar + (1 - b2) * acc * acc
        st.tensors["acc"] = torch.zeros_like(acc)
    return new_x


UPDATES: dict[str, Callable] = {"sgd": sgd, "adam": adam, "accum_adam": accum_adam}


def simulate(
    kind: str,
    mixing: Callable[[int], Tensor],
    x0: Tensor,
    grad_fn: Callable[[Tensor, int], Tensor],
    segments: Sequence[Segment],
    steps: int,
    has_grad: Callable[[int, int], bool] = lambda rank, t: True,
) -> Tensor:
    """Run ``steps`` combine-then-adapt steps; returns ``X(steps)`` (before the next mix).

    Args:
        kind: ``"sgd"``, ``"adam"`` or ``"accum_adam"``.
        mixing: ``t -> W(t)``, dense ``(n, n)``.
        x0: ``(n, d)`` start values (all rows equal after the broadcast).
        grad_fn: ``(X, t) -> G``, the ``(n, d)`` gradients at the unmixed ``X``.
        segments: the param groups as column ranges with their hyper-parameters.
        has_grad: ``(rank, t) -> False`` when that worker has no gradient at step ``t``: it still
            mixes, but its local update (and its state) is skipped, as torch.optim skips it.
    """
    x = x0.double().clone()
    n = x.shape[0]
    states = [[RefState() for _ in segments] for _ in range(n)]
    for t in range(steps):
        g = grad_fn(x, t)
        mixed = mixing(t).double() @ x
        new = mixed.clone()
        for i in range(n):
            if not has_grad(i, t):
                continue
            for seg, st in zip(segments, states[i]):
                sl = slice(seg.start, seg.stop)
                st.steps += 1
                new[i, sl] = UPDATES[kind](mixed[i, sl], g[i, sl], st, **seg.hyper)
        x = new
    return x

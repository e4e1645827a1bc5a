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
    mixing: Callable[[int], Tensor] | None,
    x0: Tensor,
    grad_fn: Callable[[Tensor, int], Tensor],
    segments: Sequence[Segment],
    steps: int,
    has_grad: Callable[[int, int], bool] = lambda rank, t: True,
    mixer: Callable[[Tensor, int], Tensor] | None = None,
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
        mixer: ``(X, t) -> mixed X`` instead of ``mixing(t) @ X`` (e.g. :class:`CompressedMixing`).
    """
    x = x0.double().clone()
    n = x.shape[0]
    states = [[RefState() for _ in segments] for _ in range(n)]
    for t in range(steps):
        g = grad_fn(x, t)
        mixed = mixer(x, t) if mixer is not None else mixing(t).double() @ x  # type: ignore[misc]
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


# -- compressed gossip (CHOCO-style, algorithms.md "Compressed gossip with error feedback") ------


def quantized(codec: str, d: Tensor) -> Tensor:
    """What every holder of a public copy adds for the difference ``d`` (one row).

    ``"bf16"``: ``d`` rounded to bfloat16. ``"int8"``: in chunks of 1024 elements from the start,
    scale ``s = max|d| / 127`` (stored as float32), values ``round(d / s)`` clipped to [-127, 127].
    """
    if codec == "bf16":
        return d.to(torch.bfloat16).to(d.dtype)
    out = torch.zeros_like(d)
    for lo in range(0, d.numel(), 1024):
        chunk = d[lo : lo + 1024]
        scale = float(torch.tensor(float(chunk.abs().max()) / 127, dtype=torch.float32))
        if scale > 0:
            out[lo : lo + 1024] = torch.clamp(torch.round(chunk / scale), -127, 127) * scale
    return out


class CompressedMixing:
    """The compressed round of every group, with the public copies, for :func:`simulate`.

    A group inside one node (``rank // local_world_size``) averages exactly. A group across nodes
    is split by node into parts (into single ranks if the parts differ in size); a part's values
    are averaged exactly, and the parts gossip on public copies ``h`` of their means ``m``:
    ``h_a += Q(m_a - h_a)`` for every part, then every member of part ``a`` takes
    ``m_a + gamma / p * sum_b (h_b - h_a)``. A group's first round sets ``h_a = m_a`` exactly.
    Round 0 is never run (all ranks hold the broadcast start values).
    """

    def __init__(self, topology, codec: str, gamma: float = 1.0) -> None:
        self.topology, self.codec, self.gamma = topology, codec, gamma
        self.copies: dict[tuple[int, ...], list[Tensor]] = {}

    def __call__(self, x: Tensor, t: int) -> Tensor:
        if t == 0:
            return x.clone()
        local = self.topology.local_world_size
        new = x.clone()
        for group in self.topology.groups(t):
            nodes = sorted({i // local for i in group})
            if len(nodes) == 1:
                new[list(group)] = x[list(group)].mean(0)
                continue
            parts = [[i for i in group if i // local == node] for node in nodes]
            if len({len(p) for p in parts}) > 1:
                parts = [[i] for i in group]
            means = [x[p].mean(0) for p in parts]
            copies = self.copies.get(tuple(group))
            if copies is None:
                copies = self.copies[tuple(group)] = [m.clone() for m in means]
            else:
                for a, m in enumerate(means):
                    copies[a] += quantized(self.codec, m - copies[a])
            for a, part in enumerate(parts):
                pull = sum(copies[b] - copies[a] for b in range(len(parts)) if b != a)
                new[part] = means[a] + self.gamma / len(parts) * pull
        return new


# -- local steps (docs/algorithms.rst "Local steps") ----------------------------------------------


def simulate_local(
    kind: str,
    mixing: Callable[[int], Tensor] | None,
    x0: Tensor,
    grad_fn: Callable[[Tensor, int], Tensor],
    segments: Sequence[Segment],
    steps: int,
    local_steps: int,
    outer: dict | None = None,
    mixer: Callable[[Tensor, int], Tensor] | None = None,
    slow: dict | None = None,
) -> Tensor:
    """Gossip every ``local_steps`` steps, the round of period ``k`` mixed at the end of period
    ``k + 1``; with ``outer`` (``lr``, ``momentum``, ``nesterov``) an outer SGD step on the anchors.

    Rows are workers. ``A`` holds the anchors (outer parameters), ``B`` the outer momentum. At the
    step that completes a period, before its update, ``A' = W(k) @ A_sent`` and
    ``X += A' - A_sent``; after the update, when the step count is a multiple of ``local_steps``:
    plain ``A = X``, sent as round ``count / local_steps``; or ``D = A - X``, ``B = mu B + D``
    (``B = D`` the first time), ``A -= lr (D + mu B)`` (Nesterov) or ``lr B``, then at once
    ``A = W(count / local_steps) @ A`` and ``X = A`` (no overlap with an outer step).

    ``slow`` (``lr``, ``momentum``, ``nesterov``, ``every``; no ``outer``): every row also keeps
    slow weights ``S`` (the start) and a momentum ``M``; when the count is a multiple of
    ``every``, after the update and before ``A = X``: ``D = S - X``, ``M = mu M + D`` (``M = D``
    the first time), ``S -= lr (D + mu M)`` (Nesterov) or ``lr M``, ``X = S``.
    """
    x = x0.double().clone()
    n = x.shape[0]
    states = [[RefState() for _ in segments] for _ in range(n)]
    anchor, momentum, sent = x.clone(), None, None
    slow_weights, slow_momentum = x.clone(), None
    for t in range(steps):
        g = grad_fn(x, t)
        if (t + 1) % local_steps == 0 and sent is not None:
            k, values = sent
            mixed = mixer(values, k) if mixer is not None else mixing(k).double() @ values  # type: ignore[misc]
            x = x + (mixed - values)
            anchor, sent = mixed, None
        new = x.clone()
        for i in range(n):
            for seg, st in zip(segments, states[i]):
                sl = slice(seg.start, seg.stop)
                st.steps += 1
                new[i, sl] = UPDATES[kind](x[i, sl], g[i, sl], st, **seg.hyper)
        x = new
        if slow is not None and (t + 1) % slow["every"] == 0:
            delta, mu = slow_weights - x, slow["momentum"]
            step = delta
            if mu:
                slow_momentum = (
                    delta.clone() if slow_momentum is None else mu * slow_momentum + delta
                )
                step = delta + mu * slow_momentum if slow["nesterov"] else slow_momentum
            slow_weights = slow_weights - slow["lr"] * step
            x = slow_weights.clone()
        if (t + 1) % local_steps:
            continue
        if outer is None:
            anchor = x.clone()
        else:
            delta, mu = anchor - x, outer["momentum"]
            step = delta
            if mu:
                momentum = delta.clone() if momentum is None else mu * momentum + delta
                step = delta + mu * momentum if outer["nesterov"] else momentum
            anchor = anchor - outer["lr"] * step
            k = (t + 1) // local_steps  # with an outer step the round is waited for at once
            anchor = mixer(anchor, k) if mixer is not None else mixing(k).double() @ anchor  # type: ignore[misc]
            x = anchor.clone()
            continue
        sent = ((t + 1) // local_steps, anchor.clone())
    return x


def worker_gradients(model: torch.nn.Module, loss: Callable) -> Callable[[Tensor, int], Tensor]:
    """``grads(x, t)`` for :func:`simulate`: row ``i`` is worker ``i``'s gradient of
    ``loss(model, i, t)`` at the parameters ``x[i]`` (``model`` is used as scratch)."""

    def grads(x: Tensor, t: int) -> Tensor:
        rows = []
        for i in range(x.shape[0]):
            torch.nn.utils.vector_to_parameters(x[i].clone(), model.parameters())
            model.zero_grad()
            loss(model, i, t).backward()
            rows.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        return torch.stack(rows)

    return grads

r"""What each simulated method does with the stacked rows between gradients (``_sim.py``).

A method is a spec string like the harness's (``methods.py``): ``ddp``,
``diloco:H16:x1.5:olr0.5:om0.7`` or ``decent:<topology>[+<codec>][:<part>]...``. The decent
parts (``x<f>`` the peak rate as a multiple of DDP's; the others as ``name<number>`` or
``name=<value>``):

* the update rule: AdamW (default, torch.optim.AdamW's arithmetic per row) or ``accum<s>``
  (AccumAdamW: the moment bases refreshed every ``s`` steps from the window's mean gradient);
  ``beta1=``, ``beta2=`` (default 0.9, 0.95, the harness's); ``vcorr<n>``: AdamW whose second
  moment is the one of a mean of ``n`` workers' gradients, estimated from the worker's own
  moments as :math:`\hat m^2 + (\hat v - \hat m^2) / n` (the noise part shrunk ``n``-fold; no
  bytes; ``n = 1`` is AdamW).
* what the round carries besides the parameters: ``gmix`` also the gradient of the step before,
  so the rule sees :math:`w_{ii} g_i(t) + \sum_{j \ne i} w_{ij} g_j(t-1)` (twice the bytes);
  ``mmix`` Adam's first moment, mixed like the parameters; ``vmix`` the gradient of the step
  before as well, but only for the second moment: each worker's denominator becomes an
  estimate of DDP's (the second moment of the mean of all n workers' gradients,
  :func:`mean_square`), its first moment stays its own fresh gradient's (twice the bytes);
  ``gmean`` (a diagnosis, with a barrier) the fresh mean of all workers' clipped gradients:
  on ``complete``, DDP but for the clipping, which is each worker's; ``vfresh`` (also a
  diagnosis) the fresh mean's square in place of ``vmix``'s estimate; ``nofloor`` drops the
  floor ``v / n`` under ``vmix``'s second moment; ``ahead`` takes each worker's gradient not
  at its own parameters but at its last mixed ones moved as they moved between the last two
  mixes (where the mean is headed), while the round still carries its own update; ``damp<c>``
  takes it at its last mixed parameters plus ``c`` times its own update since (``c = 1``: its
  own parameters, ``c = 0``: the mixed ones), the round still carrying the whole update.
* consensus control: ``pga<H>`` makes every ``H``-th round a global average (the exact mean,
  launched like a round and applied one step later); ``pgaw<K>`` only for the first ``K``
  steps, then every ``pgal<H>``-th (dense early, rare late).

A round is the package's (``decent_optim.gossip``): step ``t`` mixes the rows as they were at its
start with round ``t``'s groups, then the rule updates the mixed rows with the gradients taken at
the unmixed ones. With a codec, a group that spans nodes averages each node's part exactly and
gossips the parts' means through public copies with error feedback (CHOCO, the package's
``compressed.py``; the codec object is the package's), the first round of a group exact.
Topologies are the package's by name (``base4`` is read as ``base-4``).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

PART = re.compile(r"([A-Za-z]+\d?)=([\d.e+-]+)|([A-Za-z]+?)([\d.e+-]+)?")


def parse(spec: str) -> dict:
    """``spec`` as a dict (``kind`` and every part, a flag as True); SystemExit when malformed."""
    kind, *parts = spec.split(":")
    out: dict = {"kind": kind, "spec": spec}
    if kind == "decent":
        if not parts:
            raise SystemExit(f"{spec!r}: decent needs a topology (decent:ring)")
        out["topology"], _, codec = parts.pop(0).partition("+")
        out["codec"] = codec or None
    elif kind not in ("ddp", "diloco"):
        raise SystemExit(f"{spec!r}: the kinds are ddp, decent, diloco")
    for p in parts:
        m = PART.fullmatch(p)
        if m is None:
            raise SystemExit(f"{spec!r}: bad part {p!r}")
        name, value = (m[1], m[2]) if m[1] else (m[3], m[4])
        out[name] = True if value is None else float(value)
    return out


class AdamW:
    """torch.optim.AdamW's step on every row; ``decay`` masks weight decay per element."""

    def __init__(
        self, x: torch.Tensor, decay: torch.Tensor, betas, wd: float = 0.1, share: float = 1.0
    ) -> None:
        self.m, self.v = torch.zeros_like(x), torch.zeros_like(x)
        self.betas, self.wd, self.decay, self.t = betas, wd, decay, 0
        self.share = share
        self.u: torch.Tensor | None = None  # vmix: the second moment of the mean, estimated
        self.n, self.floor = x.shape[0], True

    def step(
        self, x: torch.Tensor, g: torch.Tensor, lr: float, u: torch.Tensor | None = None
    ) -> None:
        b1, b2 = self.betas
        self.t += 1
        self.m.lerp_(g, 1 - b1)
        self.v.mul_(b2).addcmul_(g, g, value=1 - b2)
        bc1, bc2 = 1 - b1**self.t, 1 - b2**self.t
        x.mul_(1 - lr * self.wd * self.decay)
        if u is not None:
            # vmix: the denominator is the EMA of u, an estimate of the squared mean gradient
            # of all n workers; floored at v / n, which that square's expectation cannot undercut
            self.u = torch.zeros_like(u) if self.u is None else self.u
            self.u.mul_(b2).add_(u, alpha=1 - b2)
            second = torch.maximum(self.u, self.v / self.n) if self.floor else self.u.clone()
            denom = second.div_(bc2).sqrt_().add_(1e-8)
            x.addcdiv_(self.m, denom, value=-lr / bc1)
            return
        if self.share == 1.0:
            denom = (self.v.sqrt() / bc2**0.5).add_(1e-8)
            x.addcdiv_(self.m, denom, value=-lr / bc1)
            return
        # vcorr<n>: the second moment of a mean over n workers' gradients, estimated from
        # one's own: the mean's square plus 1/n of the spread, m^2 + (v - m^2) / n
        m_hat, v_hat = self.m / bc1, self.v / bc2
        sq = m_hat.square()
        v_eff = sq + (v_hat - sq).clamp_(min=0) / self.share
        x.addcdiv_(m_hat, v_eff.sqrt_().add_(1e-8), value=-lr)


class AccumAdamW(AdamW):
    """AccumAdamW (the paper's AccumAdam, decoupled decay): ``m, v`` are the bases."""

    def __init__(self, x, decay, betas, s: int, wd: float = 0.1) -> None:
        super().__init__(x, decay, betas, wd)
        self.s, self.acc = s, torch.zeros_like(x)

    def step(self, x: torch.Tensor, g: torch.Tensor, lr: float) -> None:
        b1, b2 = self.betas
        self.t += 1
        k = -(-self.t // self.s)
        m = self.m * b1 + g * (1 - b1)
        v = (self.v * b2).addcmul_(g, g, value=1 - b2)
        bc1, bc2 = 1 - b1**k, 1 - b2**k
        x.mul_(1 - lr * self.wd * self.decay)
        x.addcdiv_(m, (v.sqrt() / bc2**0.5).add_(1e-8), value=-lr / bc1)
        self.acc.add_(g, alpha=1 / self.s)
        if self.t % self.s == 0:
            self.m.lerp_(self.acc, 1 - b1)
            self.v.mul_(b2).addcmul_(self.acc, self.acc, value=1 - b2)
            self.acc.zero_()


Groups = list[tuple[int, ...]]


def mean_square(g: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Each row's estimate of the squared mean of all n rows' gradients ``g`` (n, P), from the
    gradients of its group alone (``vmix``).

    With i.i.d. noise of variance s^2 per worker, a group of k has ``a`` (the square of its
    mean) and ``b`` (the mean of its squares) of expectations ``mu^2 + s^2 / k`` and
    ``mu^2 + s^2``, so ``a - (b - a) (1 - k / n) / (k - 1)`` has expectation ``mu^2 + s^2 / n``:
    what DDP's second moment averages. A row alone in its round gets its own square.
    """
    n, out = g.shape[0], g.square()
    for grp in groups:
        k = len(grp)
        if k == 1:
            continue
        idx = list(grp)
        a = g[idx].mean(0).square()
        b = g[idx].square().mean(0)
        out[idx] = (a - (b - a) * ((1 - k / n) / (k - 1))).unsqueeze(0)
    return out


def topology_groups(name: str, n: int, lws: int) -> Callable[[int], Groups]:
    if re.fullmatch(r"base\d+", name):  # the name of the first runs: the package's base-<b>
        name = f"base-{name[4:]}"
    from decent_optim.topologies import get

    topo = get(name, n, lws)

    def groups(r: int) -> Groups:
        g = topo.groups(r)
        if g is None:
            raise SystemExit(f"{name}: a round with weights that are no partition into groups")
        return g

    return groups


class Gossip:
    """One round of the package's gossip on stacked rows, exact or through a codec."""

    def __init__(
        self, groups: Callable[[int], Groups], lws: int, codec: str | None,
        buckets: list[torch.Tensor] | None = None,
    ) -> None:  # fmt: skip
        self.groups, self.lws = groups, lws
        # a codec's scales are per chunk of a bucket: the elements in the package's bucket order
        self.order = None if buckets is None else torch.cat(buckets)
        self.bounds = [0]
        for b in buckets or []:
            self.bounds.append(self.bounds[-1] + len(b))
        self.codec = None
        if codec:
            from decent_optim.gossip import codecs

            self.codec = codecs.get(codec)
        self.copies: dict[tuple[int, ...], torch.Tensor] = {}  # per group: (parts, P)

    def mix_(self, x: torch.Tensor, r: int, extra: list[torch.Tensor] = ()) -> None:
        """Round ``r`` on ``x`` in place; ``extra`` rows (moments) are mixed exactly alike."""
        for g in self.groups(r):
            if len(g) == 1:
                continue
            idx = list(g)
            for t in extra:
                t[idx] = t[idx].mean(0, keepdim=True)
            parts = self._parts(g)
            if self.codec is None or len(parts) == 1:
                x[idx] = x[idx].mean(0, keepdim=True)
            else:
                self._compressed_(x, g, parts)

    def _parts(self, g: tuple[int, ...]) -> list[list[int]]:
        by_node: dict[int, list[int]] = {}
        for i in g:
            by_node.setdefault(i // self.lws, []).append(i)
        return list(by_node.values())

    def _compressed_(self, x: torch.Tensor, g, parts: list[list[int]]) -> None:
        assert self.codec is not None
        means = torch.stack([x[p].mean(0) for p in parts])
        if self.order is not None:
            means = means[:, self.order]
        bounds = self.bounds if self.order is not None else [0, x.shape[1]]
        copies = self.copies.get(g)
        if copies is None:  # the group's first round: exact values fill the copies
            self.copies[g] = copies = means.clone()
        else:
            for lo, hi in zip(bounds, bounds[1:]):
                payload = torch.empty(self.codec.nbytes(hi - lo), dtype=torch.uint8)
                for a in range(len(parts)):
                    self.codec.encode_(means[a, lo:hi], copies[a, lo:hi], payload, absorb=True)
        gamma, p = self.codec.gamma, len(parts)
        total = copies.sum(0)
        for a, members in enumerate(parts):
            # m_a + gamma / p * sum_b (xhat_b - xhat_a)
            mixed = means[a] + gamma / p * (total - p * copies[a])
            if self.order is not None:
                mixed = torch.empty_like(mixed).index_copy_(0, self.order, mixed)
            x[members] = mixed


class Method:
    """A method on ``task``'s rows: ``step(t, lr_factor)``, then ``consensus()`` is the model."""

    def __init__(self, spec: str, task, lr: float, decent_lr_factor: float = 2.0) -> None:
        self.m = m = parse(spec)
        self.task = task
        betas = (m.get("beta1", 0.9), m.get("beta2", 0.95))
        if m["kind"] == "ddp":
            self.peak, self.x = lr * m.get("x", 1.0), task.start.unsqueeze(0).clone()
        else:
            base = lr * decent_lr_factor if m["kind"] == "decent" else lr
            self.peak, self.x = lr * m["x"] if "x" in m else base, task.initial()
        s = int(m.get("accum", 1))
        self.rule = (AccumAdamW(self.x, task.decay, betas, s) if s > 1
                     else AdamW(self.x, task.decay, betas, share=m.get("vcorr", 1.0)))  # fmt: skip
        self.rule.floor = "nofloor" not in m
        if m["kind"] == "diloco":
            self.h, self.theta, self.buf = int(m.get("H", 1)), task.start.clone(), None
        if m["kind"] == "decent":
            groups = topology_groups(m["topology"], task.n, task.local_world_size)
            self.gossip = Gossip(groups, task.local_world_size, m["codec"], task.buckets)
            self.prev: torch.Tensor | None = None  # gmix's gradient of the step before
            self.vprev: torch.Tensor | None = None  # vmix's
        self.global_rounds = 0
        self.mixed: torch.Tensor | None = None  # ahead: the rows after the last two mixes
        self.mixed_before: torch.Tensor | None = None

    def consensus(self) -> torch.Tensor:
        return self.x.mean(0)

    def _global(self, t: int) -> bool:
        m = self.m
        if t == 0:
            return False
        if "pgaw" in m and t < m["pgaw"]:
            return t % int(m.get("pga", 1)) == 0
        every = m.get("pgal", m.get("pga")) if "pgaw" in m else m.get("pga")
        return every is not None and t % int(every) == 0

    @torch.no_grad()
    def step(self, t: int, factor: float) -> None:
        lr, kind, x = self.peak * factor, self.m["kind"], self.x
        if kind == "ddp":
            with torch.enable_grad():
                g = self.task.ddp_grad(x[0], t).unsqueeze(0)
            self.rule.step(x, g, lr)
            return
        at = x
        if "damp" in self.m and self.mixed is not None:
            # the gradient nearer the mean: a worker's own update counts c-fold, not whole
            at = self.mixed + self.m["damp"] * (x - self.mixed)
        if "ahead" in self.m and self.mixed is not None:
            # the gradient where the mean will be: the last mixed rows moved as they moved last
            last = self.mixed if self.mixed_before is None else self.mixed_before
            at = self.mixed + (self.mixed - last)
        with torch.enable_grad():
            g = self.task.grads(at, t)
        if kind == "diloco":
            self.rule.step(x, g, lr)
            if (t + 1) % self.h == 0:
                self._outer()
            return
        u = self._mean_square(g, t) if "vmix" in self.m else None
        if "vfresh" in self.m:  # a diagnosis, with a barrier: the fresh mean's square
            u = g.mean(0, keepdim=True).square().expand_as(g)
        if "gmix" in self.m:
            g = self._mixed_gradient(g, t)
        if "gmean" in self.m:  # a barrier: the fresh mean of the clipped gradients, no gossip
            g[:] = g.mean(0, keepdim=True)
        if self._global(t):
            x[:] = x.mean(0, keepdim=True)
            self.global_rounds += 1
            if "mmix" in self.m:
                self.rule.m[:] = self.rule.m.mean(0, keepdim=True)
        elif t > 0:  # round 0 would mix the start, equal everywhere: the package skips it
            self.gossip.mix_(x, t, [self.rule.m] if "mmix" in self.m else [])
        if "ahead" in self.m or "damp" in self.m:
            self.mixed_before, self.mixed = self.mixed, x.clone()
        self.rule.step(x, g, lr, u) if u is not None else self.rule.step(x, g, lr)

    def _mean_square(self, g: torch.Tensor, t: int) -> torch.Tensor:
        """``vmix``: the gradients of the step before travel with round ``t``."""
        prev, self.vprev = getattr(self, "vprev", None), g.clone()
        if prev is None:
            return g.square()
        groups = [tuple(range(self.task.n))] if self._global(t) else self.gossip.groups(t)
        return mean_square(prev, groups)

    def _mixed_gradient(self, g: torch.Tensor, t: int) -> torch.Tensor:
        """``w_ii g_i(t) + sum_j w_ij g_j(t - 1)`` with round ``t``'s groups (uniform weights)."""
        prev, self.prev = (g if self.prev is None else self.prev), g.clone()
        out = g.clone()
        groups = [tuple(range(self.task.n))] if self._global(t) else self.gossip.groups(t)
        for grp in groups:
            idx = list(grp)
            out[idx] = prev[idx].mean(0, keepdim=True) + (g[idx] - prev[idx]) / len(grp)
        return out

    def _outer(self) -> None:
        """DiLoCo's outer step (``_diloco.py``): Nesterov SGD on the mean pseudo-gradient."""
        lr, mu = self.m.get("olr", 0.7), self.m.get("om", 0.9)
        delta = self.theta - self.x.mean(0)
        self.buf = delta.clone() if self.buf is None else self.buf.mul_(mu).add_(delta)
        self.theta.sub_(delta + mu * self.buf, alpha=lr)
        self.x[:] = self.theta

"""The time-to-quality harness's methods: one registry entry per family.

A method is a spec string ``<family>[:<first>][:<part>]...``: the family names an entry of
``REGISTRY``; ``decent`` and ``decentdp`` take a topology first (``<topology>[+<codec>]``); every
other part is a flag (``outer``) or a letter prefix and a number (``H4``, ``x1.5``, ``olr0.7``)
that the entry must list. ``parse`` gives the method as a dict (every key, its default where the
spec leaves it out), ``Entry.build`` its model wrapper and optimizer for the worker loop
(``_worker.py``), ``Entry.wire`` its bytes sent per step, ``local_steps`` each rank's H
(``:hetero``: from its speed). ``decent:...:node`` shards each node's one replica over its ranks
(FSDP2) and gossips across nodes. Peak rates: ``--lr`` for DDP, DiLoCo, the streaming peers and
``decent`` with an outer step; ``--lr`` x ``--decent-lr-factor`` for gossip, Decent-DP and
``diloco:...:avg``; ``:x<f>`` sets it to ``--lr`` x f. Adding a peer is adding one entry (and
its part names to ``PARTS`` if new).
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULTS: dict[str, Any] = {
    "topology": None, "compression": None, "H": 1, "outer": False, "avg": False,
    "uneven": False, "fixed": False, "cap": None, "slow": None, "x": None, "olr": None,
    "om": None, "F": 1, "tau": 0, "alpha": 0.0, "bits": None, "gamma": None, "hetero": False,
    "node": False,
}  # fmt: skip
# a part's letters -> (key, value type); a flag (no number) has type bool
PARTS: dict[str, tuple[str, type]] = {
    "H": ("H", int), "x": ("x", float), "olr": ("olr", float), "om": ("om", float),
    "g": ("gamma", float), "cap": ("cap", float), "slow": ("slow", int), "F": ("F", int),
    "tau": ("tau", int), "alpha": ("alpha", float), "q": ("bits", int), "outer": ("outer", bool),
    "avg": ("avg", bool), "uneven": ("uneven", bool), "fixed": ("fixed", bool),
    "hetero": ("hetero", bool), "node": ("node", bool),
}  # fmt: skip
PART = re.compile(r"([A-Za-z]+?)(\d[\d.e+-]*)?")


@dataclass
class Built:
    """What the worker loop drives: ``net`` forward and backward, ``opt`` steps (None where the
    wrapper steps inside backward, Decent-DP), ``averaged()`` holds the consensus model."""

    net: Any
    opt: Any
    peak: float
    averaged: Callable[[], contextlib.AbstractContextManager]
    steps_in_backward: bool = False


@dataclass
class Entry:
    build: Callable[[dict, Any], Built]  # (parsed method, worker context) -> Built
    parts: tuple[str, ...] = ()
    topology_first: bool = False
    missing: Callable[[str], str | None] = lambda spec: None  # why it cannot run here, or None

    def wire(self, opt, spec: str, n: int, params, steps: int) -> float | None:
        """Bytes a rank sent per step: the optimizer's count where it keeps one; DDP's fp32 ring
        all-reduce, 2 (n - 1) / n x 4 bytes a parameter; None for the others."""
        sent = getattr(opt, "bytes_sent", None)
        if isinstance(sent, int) and steps:
            return sent / steps
        if spec == "ddp":
            return 2 * (n - 1) / n * 4 * sum(p.numel() for p in params)
        return None


def parse(spec: str) -> dict:
    """``spec`` as a dict of ``DEFAULTS``' keys plus ``kind``; SystemExit says what is wrong."""
    kind, _, rest = spec.partition(":")
    entry = REGISTRY.get(kind)
    if entry is None:
        raise SystemExit(f"unknown method {spec!r}: the families are {', '.join(REGISTRY)}")
    out = {"kind": kind, **DEFAULTS}
    parts = rest.split(":") if rest else []
    if entry.topology_first and parts:  # else the optimizer's default topology
        out["topology"], _, codec = parts.pop(0).partition("+")
        out["compression"] = codec or None
    for p in parts:
        match = PART.fullmatch(p)
        letters = match[1] if match else p
        if letters not in entry.parts:
            allowed = ", ".join(entry.parts) or "none"
            raise SystemExit(f"bad method {spec!r}: unknown part {p!r} (parts of {kind}: {allowed})")  # fmt: skip
        key, kind_of = PARTS[letters]
        if (kind_of is bool) != (match[2] is None):
            raise SystemExit(f"bad method {spec!r}: {p!r} " + (
                "takes no number" if kind_of is bool else f"needs a number ({letters}2)"))  # fmt: skip
        try:
            out[key] = True if kind_of is bool else kind_of(match[2])
        except ValueError:
            what = "an integer" if kind_of is int else "a number"
            raise SystemExit(f"bad method {spec!r}: {p!r} needs {what}") from None
    if out["bits"] not in (None, 4, 8):
        raise SystemExit(f"bad method {spec!r}: the exchange is q4 or q8")
    if out["gamma"] is not None and not (out["compression"] or "").startswith(
        ("rand", "top", "int4", "int2")
    ):
        raise SystemExit(f"bad method {spec!r}: g<gamma> needs a sparse or 4-/2-bit codec")
    if (out["fixed"] or out["cap"] is not None) and not out["uneven"]:
        raise SystemExit(f"bad method {spec!r}: fixed/cap<c> need :uneven")
    if (out["olr"] is not None or out["om"] is not None) and kind == "decent" and not out["slow"]:
        raise SystemExit(f"bad method {spec!r}: olr/om need diloco or :slow<every>")
    return out


def _rates(m: dict) -> dict:
    """The outer optimizer's rates the spec sets (``olr``, ``om``)."""
    return {k: m[o] for k, o in (("lr", "olr"), ("momentum", "om")) if m[o] is not None}


def _peak(m: dict, ctx, base: float) -> float:
    return base if m["x"] is None else ctx.args.lr * m["x"]


def _ddp(m: dict, ctx) -> Built:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    net = DistributedDataParallel(ctx.model)
    opt = torch.optim.AdamW(ctx.groups, lr=ctx.args.lr, betas=ctx.betas)
    return Built(net, opt, ctx.args.lr, contextlib.nullcontext)


def _none(m: dict, ctx) -> Built:
    """No communication: every rank trains alone (the floor of what a method saves by sending
    less); its consensus is still the workers' mean."""
    import torch
    from _diloco import averaged_parameters

    peak = _peak(m, ctx, ctx.args.lr)
    opt = torch.optim.AdamW(ctx.groups, lr=peak, betas=ctx.betas)
    opt.bytes_sent = 0  # type: ignore[attr-defined]
    return Built(ctx.model, opt, peak, lambda: averaged_parameters(ctx.params))


def _codec(m: dict):
    """``compression=`` for ``decent``: the name, or with ``:g<gamma>`` the codec object with
    that consensus step."""
    if m["gamma"] is None:
        return m["compression"]
    from decent_optim.gossip import codecs

    own = codecs.get(m["compression"])
    bits = None if own.spec.bits == 32 else own.spec.bits
    if own.spec.keep == "all":
        return codecs.Quantized(own.spec.bits, gamma=m["gamma"])
    return type(own)(own.spec.percent, bits, gamma=m["gamma"])


def _decent(m: dict, ctx) -> Built:
    import decent_optim as dopt

    peak = _peak(m, ctx, ctx.args.lr if m["outer"] else ctx.decent_lr)
    outer: Any = "diloco" if m["outer"] else None
    if m["slow"]:
        outer = dopt.LocalOuterSGD(every=m["slow"], **_rates(m))
    uneven: Any = False
    if m["uneven"]:
        cap = {} if m["cap"] is None else {"cap": m["cap"]}  # else Uneven's default
        uneven = dopt.Uneven(adaptive=not m["fixed"], **cap)
    groups, gossip = ctx.groups, dict(local_world_size=ctx.args.local_world_size or None)
    if m["node"]:
        from _sharded import shard_in_the_node

        gossip = shard_in_the_node(ctx.model, ctx.args.local_world_size)
        groups = ctx.groups_of(list(ctx.model.parameters()))  # the sharded parameters
    opt = dopt.DecentralizedAdamW(
        groups, lr=peak, betas=ctx.betas, topology=m["topology"], compression=_codec(m),
        local_steps=m["H"], outer=outer, uneven=uneven, **gossip,
    )  # fmt: skip
    return Built(ctx.model, opt, peak, lambda: opt.averaged(ctx.model))


def _diloco(m: dict, ctx) -> Built:
    import torch
    from _diloco import DiLoCo

    # avg: plain averaging (outer lr 1, no momentum) at the gossip methods' rate, the best
    # DiLoCo variant of the convergence study at small H (the published outer step overshoots)
    peak = _peak(m, ctx, ctx.decent_lr if m["avg"] else ctx.args.lr)
    outer = {**(dict(lr=1.0, momentum=0.0, nesterov=False) if m["avg"] else {}), **_rates(m)}
    inner = torch.optim.AdamW(ctx.groups, lr=peak, betas=ctx.betas)
    opt = DiLoCo(ctx.params, inner, ctx.H, **outer)
    return Built(ctx.model, opt, peak, opt.averaged)


def _streaming(m: dict, ctx) -> Built:
    import _peers
    import torch

    peak = _peak(m, ctx, ctx.args.lr)
    inner = torch.optim.AdamW(ctx.groups, lr=peak, betas=ctx.betas)
    layers = _peers.layer_modules(ctx.model)
    if m["kind"] == "sdiloco":
        from _streaming_diloco import StreamingDiLoCo

        opt: Any = StreamingDiLoCo([list(layer.parameters()) for layer in layers], inner, m["H"],
                                   fragments=m["F"], delay=m["tau"], alpha=m["alpha"],
                                   bits=m["bits"], **_rates(m))  # fmt: skip
    else:
        opt = _peers.TorchftDiLoCo(ctx.model, layers, inner, {**m, "H": ctx.H}, _rates(m))
    return Built(ctx.model, opt, peak, opt.averaged)


def _decentdp(m: dict, ctx) -> Built:
    from functools import partial

    import torch
    from decent_dp.ddp import DecentralizedDataParallel
    from decent_dp.optim import optim_fn_adamw

    fn = partial(optim_fn_adamw, lr=ctx.decent_lr, beta1=0.9, beta2=0.95, weight_decay=0.1)
    net = DecentralizedDataParallel(
        ctx.model, optim_fn=fn, grad_clip_norm=1.0, topology=m["topology"],
        lr_scheduler_fn=lambda o: torch.optim.lr_scheduler.LambdaLR(o, ctx.lr_factor),
    )  # fmt: skip
    net.train()

    @contextlib.contextmanager
    def averaged():
        net.global_avg(will_revert=True)
        try:
            yield
        finally:
            net.revert_global_avg()

    return Built(net, None, ctx.decent_lr, averaged, steps_in_backward=True)


def _torchft_missing(spec: str) -> str | None:
    if importlib.util.find_spec("torchft") is None:
        return "skipped, torchft is not installed (pip install torchft==0.2.0)"
    if ":q" in spec and importlib.util.find_spec("triton") is None:
        return "torchft quantizes only with triton; here it sent fp32"  # a note, it still runs
    return None


def _decentdp_missing(spec: str) -> str | None:
    probe = subprocess.run([sys.executable, "-c", "import decent_dp"], capture_output=True)
    why = "skipped, decent_dp does not import (pip install decent-dp==0.2.3)"
    return why if probe.returncode else None


TUNE = ("x", "olr", "om")
STREAM = ("H", "F", "tau", "alpha", "q", *TUNE)
REGISTRY: dict[str, Entry] = {
    "ddp": Entry(_ddp),
    "decent": Entry(
        _decent, ("H", "outer", "uneven", "fixed", "cap", "slow", "g", "node", *TUNE), True
    ),
    "decentdp": Entry(_decentdp, (), True, _decentdp_missing),
    "diloco": Entry(_diloco, ("H", "avg", "hetero", *TUNE)),
    "sdiloco": Entry(_streaming, STREAM),
    "torchft-diloco": Entry(_streaming, (*STREAM, "hetero"), missing=_torchft_missing),
    "torchft-sdiloco": Entry(_streaming, (*STREAM, "hetero"), missing=_torchft_missing),
    "none": Entry(_none, ("x",)),
}


def local_steps(m: dict, speeds: str | None, n: int) -> list[int]:
    """Each rank's inner steps between syncs: ``H``, or with ``:hetero`` round(H x the rank's
    ``--speeds`` factor) (Python's round; torchft's answer to uneven devices, a ``sync_every``
    per replica: a half-speed rank syncs after half the steps, so all reach a sync together)."""
    import _devices

    if not m["hetero"]:
        return [m["H"]] * n
    speed = _devices.speeds_of(speeds, n)
    hs = [round(m["H"] * s) for s in speed]
    f, tau = m["F"], m["tau"]
    for r, h in enumerate(hs):
        if h < 1 or h % f or h // f <= tau:
            raise SystemExit(f"{m['kind']} :hetero: rank {r}'s H round({m['H']} x {speed[r]:g}) "
                             f"= {h}; every rank's must be >= 1, a multiple of F ({f}) and more "
                             f"than F x tau ({f * tau}): pick H (or --speeds) to fit")  # fmt: skip
    return hs


def not_step_locked(spec: str) -> str | None:
    """Why ``spec`` is not step-locked, so that its time to quality needs a full run
    (``report.py --compose`` and ``--timing-steps`` refuse it), or None."""
    m = parse(spec)
    if m["uneven"]:
        return "arrivals decide the mixing"
    return "each rank's H follows its speed" if m["hetero"] else None


def node_blind(spec: str) -> bool:
    """Whether ``spec`` trains alike whatever the ranks per node: all but the gossip methods, whose
    topology and compression follow the nodes (DDP and DiLoCo average exactly on any shape)."""
    return not REGISTRY[parse(spec)["kind"]].topology_first


def period(spec: str) -> int:
    """Steps after which a step-locked method's work repeats: its longest period (with a delay)."""
    return max((m := parse(spec))["H"], m["slow"] or 1) + m["tau"]

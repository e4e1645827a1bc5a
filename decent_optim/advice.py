"""The one source of recommendations: :func:`recommend` says which line to write for a cluster.

Pure Python (no process group needed): give the layout (``nodes``, ``workers_per_node``), the
regime (``params``, ``link``, ``step_ms``, or ``r`` directly), and optionally ``speeds``,
``failures`` and the schedule's ``steps``; it returns an :class:`Advice` with the keyword
arguments for the optimizer, the learning-rate rule, the reason, and whether DDP is the better
choice. The rules and the measurements behind them are in :mod:`decent_optim._advice_rules`;
``python -m decent_optim.plan`` prints this, and the README's table is checked against it.

>>> import decent_optim
>>> decent_optim.recommend(nodes=1, workers_per_node=8).use_ddp
True
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from decent_optim import _advice_rules as rules
from decent_optim.optim.outer import LocalOuterSGD
from decent_optim.runtime import regimes

__all__ = ["Advice", "recommend"]

DDP_LINE = "keep torch.optim.AdamW under DistributedDataParallel"


@dataclass(frozen=True)
class Advice:
    """What :func:`recommend` returns.

    ``kwargs`` are the keyword arguments for :class:`~decent_optim.DecentralizedAdamW` besides
    the parameters and ``lr`` (``lr = lr_scale x`` the rate tuned for DDP); ``membership`` is
    not among them, as it needs the job's store, nor ``process_group`` where ``sharded`` (one
    FSDP2 replica per node): :attr:`line` writes both out. ``use_ddp`` says
    DDP is the better choice (``kwargs`` then is what to write if ours is wanted anyway);
    ``verdict`` is how ours with ``kwargs`` compared with DDP where it was measured.
    """

    use_ddp: bool
    verdict: str  # "wins", "ties" or "loses" against DDP, as measured
    kwargs: dict[str, Any]
    reason: str
    r: float | None = None
    needs: tuple[str, ...] = ()
    membership: bool = False
    sharded: bool = False  # one FSDP2 replica per node: process_group=mesh["replicate"]
    lr_scale: float = rules.LR_SCALE
    lr_rule: str = rules.LR_RULE
    source: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def line(self) -> str:
        """The line to write: DDP's, or ``DecentralizedAdamW(...)`` with :attr:`kwargs`."""
        if self.use_ddp:
            return DDP_LINE
        return self.decentralized_line

    @property
    def decentralized_line(self) -> str:
        """``DecentralizedAdamW(...)`` with :attr:`kwargs`, also where DDP is the better choice."""
        parts = [f"lr={self.lr_scale:g} * ddp_lr"]
        parts += [f"{k}={self.source.get(k, _literal(v))}" for k, v in self.kwargs.items()]
        if self.sharded:
            parts.append('process_group=mesh["replicate"]')
        if self.membership:
            parts.append(f"membership=Membership(store, timeout={rules.MEMBERSHIP_TIMEOUT_S})")
        return f"DecentralizedAdamW(params, {', '.join(parts)})"

    def text(self) -> str:
        """The advice as ``python -m decent_optim.plan`` prints it."""
        lines = [f"the line to write: {self.line}"]
        if self.use_ddp:
            lines.append(f"  (ours, if you want it anyway: {self.decentralized_line})")
        lines.append(f"against DDP, measured: ours {self.verdict}")
        lines.append(f"why: {self.reason}")
        lines += [f"also: {need}" for need in self.needs]
        if not self.use_ddp:
            lines.append(f"learning rate: {self.lr_rule}")
        return "\n".join(lines)


def _literal(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def _positive(name: str, value: Any, integer: bool = False) -> Any:
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        what = "an int" if integer else "a number"
        raise TypeError(f"recommend(): {name} must be {what} > 0, got {value!r}")
    if not (math.isfinite(float(value)) and float(value) > 0):
        raise ValueError(f"recommend(): {name} must be finite and > 0, got {value!r}")
    return value


def _regime(params: Any, link: Any, step_ms: Any, r: Any) -> float | None:
    parts = {"params": params, "link": link, "step_ms": step_ms}
    given = [k for k, v in parts.items() if v is not None]
    if r is not None:
        if given:
            raise ValueError(
                f"recommend(): give r= or params=, link=, step_ms=, not both (got r and {given})"
            )
        return float(_positive("r", r))
    if not given:
        return None
    missing = [k for k, v in parts.items() if v is None]
    if missing:
        raise ValueError(
            f"recommend(): R needs params=, link= and step_ms= together; add {', '.join(missing)}"
        )
    bits = regimes.link_bits(link) if isinstance(link, str) else _positive("link", link)
    return regimes.ratio(_positive("params", params), bits, _positive("step_ms", step_ms) / 1e3)


def _uneven(speeds: Sequence[float] | None, workers: int | None) -> bool:
    if speeds is None:
        return False
    if isinstance(speeds, (str, bytes)) or not isinstance(speeds, Sequence) or not speeds:
        raise TypeError(f"recommend(): speeds must be a list of numbers, got {speeds!r}")
    for s in speeds:
        _positive("every speed", s)
    if workers is not None and len(speeds) != workers:
        raise ValueError(
            f"recommend(): speeds needs one factor per worker: {workers} workers "
            f"(nodes x workers_per_node), got {len(speeds)}"
        )
    return min(speeds) / max(speeds) < rules.UNEVEN_BELOW


def recommend(
    *,
    params: float | None = None,
    link: str | float | None = None,
    step_ms: float | None = None,
    r: float | None = None,
    nodes: int | None = None,
    workers_per_node: int = 1,
    speeds: Sequence[float] | None = None,
    failures: bool = False,
    steps: int | None = None,
) -> Advice:
    """The line to write for a cluster, with its reason (every rule measured: see the module).

    ``link`` is a node's uplink, as ``"10gbit"`` or bits per second; ``r`` replaces ``params``,
    ``link`` and ``step_ms`` (R = 32 x params / link bit/s / step seconds). ``nodes`` None means
    several nodes of unknown count (the topology then assumes a power of two). ``speeds`` is a
    factor per worker (1 1 1 0.5: the last at half speed); ``failures`` asks for a run that
    survives lost workers; ``steps`` is the schedule's length, which decides at slow links.
    """
    if nodes is not None:
        _positive("nodes", nodes, integer=True)
    _positive("workers_per_node", workers_per_node, integer=True)
    if steps is not None:
        _positive("steps", steps, integer=True)
    if not isinstance(failures, bool):
        raise TypeError(f"recommend(): failures must be True or False, got {failures!r}")
    r_value = _regime(params, link, step_ms, r)
    workers = None if nodes is None else nodes * workers_per_node
    if workers == 1:
        raise ValueError("recommend(): one worker in all: nothing to average; keep torch.optim")
    uneven = _uneven(speeds, workers)
    if nodes == 1:
        return _finish(rules.one_machine(workers_per_node), None, uneven, failures, many=False)
    if r_value is None:
        raise ValueError(
            "recommend(): several nodes: give params=, link= and step_ms= (or r=) so that R, "
            "the steps one float32 copy takes over a node's uplink, can be computed"
        )
    many = workers is not None and workers >= rules.MANY_WORKERS
    base = rules.between_nodes(r_value, nodes, workers_per_node, many, steps)
    if uneven or failures:  # their measured settings are a replica per rank
        base["needs"], base["sharded"] = (), False
        if many:
            base["kwargs"]["topology"] = rules.across_nodes(nodes, workers_per_node, r_value)
    return _finish(base, r_value, uneven, failures, many)


def _finish(
    base: dict[str, Any], r: float | None, uneven: bool, failures: bool, many: bool
) -> Advice:
    kwargs: dict[str, Any] = base["kwargs"]
    source: dict[str, str] = dict(base.get("source", {}))
    reasons = [base["reason"]]
    needs = list(base.get("needs", ()))
    use_ddp, verdict = base["use_ddp"], base["verdict"]
    if uneven:
        if r is None or many:  # one machine, or 16+ workers: the uneven page's setting
            kwargs["local_steps"] = max(kwargs.get("local_steps", 1), rules.UNEVEN_LOCAL_STEPS)
            if r is None:
                kwargs["topology"] = "ring"
            if many and "outer" not in kwargs:
                kwargs["outer"] = LocalOuterSGD(**rules.UNEVEN_MANY_OUTER)
                spec = ", ".join(f"{k}={v}" for k, v in rules.UNEVEN_MANY_OUTER.items())
                source["outer"] = f"LocalOuterSGD({spec})"
        kwargs["uneven"] = True
        use_ddp, verdict = False, "wins"
        reasons.append(
            "uneven speeds: DDP runs at the slowest worker's pace (1.63-1.81x its even time with "
            "one at half speed), uneven=True at the mean speed (1.07-1.15x)"
        )
    if failures:
        use_ddp = False
        if verdict == "loses":
            verdict = "loses on time without failures, and survives the failures DDP does not"
        reasons.append(
            "failures: with membership= the survivors train on (0.55-1.5 s from a SIGKILL to "
            "their next step, no step lost), where a DDP job ends and restarts from disk"
        )
        needs.append(rules.FAILURES_NEEDS)
    return Advice(
        use_ddp=use_ddp,
        verdict=verdict,
        kwargs=kwargs,
        reason="; ".join(reasons),
        r=r,
        needs=tuple(needs),
        membership=failures,
        sharded=base.get("sharded", False),
        source=source,
    )

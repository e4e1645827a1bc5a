"""Golden traces of the schedules of rounds: per-step hashes of everything a step leaves behind.

Test files import it by its top-level name, as ``_harness``. Each rank trains ``_live``'s float64
``Linear(3, 2)`` with ``DecentralizedAdamW`` on the ring (every rank a node of its own, so that
``compression="int8"`` compresses every pair) and, after every step, records

* ``count`` (its steps), ``opt.round`` and ``opt.progress``;
* a hash of its parameters' bytes;
* a hash of its whole ``state_dict()``: Adam's buffers and step, and the package's entry (the
  round counter, whether a round is in flight, the anchors, outer momentum, slow weights and
  their momentum, where uneven periods stand) but for the public copies of compressed gossip:
  those of the neighbours are written when their part of the round in flight comes in, so a
  state dict taken while a round travels holds old or new ones by timing (the parameters'
  hash shows their effect at the next mix).

The traces were recorded on the code before the schedule layer was rebuilt (issue 62,
``tests/golden_traces.json``); the test replays them and compares bit for bit.

**What is deterministic.** Every step-locked schedule is. ``uneven=True`` mixes a round when it
has arrived, which depends on timing; ``Uneven(cap=1)`` makes a rank wait for the round at the
``local_steps``-th step of each period, so it is step-locked and deterministic (its periods,
progress and budget are still the uneven ones). The default cap (8) is not traced: its values
depend on when transfers complete.

**A kill and a join, made deterministic.** Today a survivor notices a loss where a round to the
dead rank fails, which depends on when the transport sees the closed connection (the
survivors' counts at the change then differ by a step or two). Here every rank first settles
the round in flight (``opt.synchronize()``) and meets the others at a store barrier; then the
victim kills itself, and rank 0 starts the change through the store (as a member that noticed
a loss does): every survivor sees it at its next launch, at the same count, with nothing of a
failed round in flight. A newcomer asks to join at another barrier, and the members go on only
once its request is in the store, so that all of them see it at the same launch too.
"""

from __future__ import annotations

import copy
import hashlib
import os
import signal
import time

import _live

STEPS = 16
KILL_AT, VICTIM = 4, 2  # after the victim's 4th step
JOIN_AT = 10  # after the survivors' 10th step
TIMEOUT = 2.0  # the membership agreement's bound on each wait
PATIENT = 30.0  # the optimizer's timeout

#: the schedules of rounds (keyword settings, built on the ranks by :func:`_keywords`)
SCHEDULES = {
    "every": {},
    "every+pga4": {"global_avg_every": 4},
    "H2": {"local_steps": 2},
    "H2+pga4": {"local_steps": 2, "global_avg_every": 4},
    "H2+diloco": {"local_steps": 2, "outer": "diloco"},
    "H2+outersgd": {
        "local_steps": 2,
        "outer": ("OuterSGD", {"lr": 0.5, "momentum": 0.5, "nesterov": False}),
    },
    "H2+slow4": {"local_steps": 2, "outer": ("LocalOuterSGD", {"every": 4})},
    # every 8: the join (at count 12) falls between two slow steps, where x and theta differ
    "H2+slow8": {"local_steps": 2, "outer": ("LocalOuterSGD", {"every": 8})},
    "uneven1": {"local_steps": 2, "uneven": {"cap": 1}},
    "uneven1+slow3": {
        "local_steps": 2,
        "uneven": {"cap": 1},
        "outer": ("LocalOuterSGD", {"every": 3}),
    },
}
CODECS = (None, "int8")
#: the schedules that took membership= before issue 62
LIVE = ("every", "H2", "uneven1")
#: those that take it since (traced after they were built, checked against :func:`simulate`)
LIVE_OUTER = ("H2+diloco", "H2+slow8")


def _keywords(schedule: str) -> dict:
    import decent_optim

    out = dict(SCHEDULES[schedule])
    outer = out.get("outer")
    if isinstance(outer, tuple):
        out["outer"] = getattr(decent_optim, outer[0])(**outer[1])
    if "uneven" in out:
        out["uneven"] = decent_optim.Uneven(**out["uneven"])
    return out


def digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _walk(value, path, out):
    """Every tensor and plain value of a state dict, in a fixed order, as bytes."""
    import torch

    if isinstance(value, dict):
        for key in sorted(value, key=repr):
            if key != "public_copies":  # (module docstring)
                _walk(value[key], f"{path}/{key!r}", out)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _walk(item, f"{path}[{i}]", out)
    elif isinstance(value, torch.Tensor):
        t = value.detach().contiguous().cpu()
        out.append(f"{path}:{t.dtype}:{tuple(t.shape)}".encode())
        out.append(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        out.append(f"{path}={value!r}".encode())


def record(opt, params, count):
    """One step's line of the trace."""
    import torch

    flat = torch.cat([p.detach().reshape(-1) for p in params])
    parts: list[bytes] = []
    _walk(opt.state_dict(), "", parts)
    return [
        count,
        opt.round,
        repr(opt.progress),
        digest(flat.numpy().tobytes()),
        digest(b"|".join(parts)),
    ]


def _optimizer(params, schedule, codec, membership=None):
    from decent_optim import DecentralizedAdamW

    opt = DecentralizedAdamW(
        params,
        lr=_live.LR,
        topology="ring",
        timeout=PATIENT,
        local_world_size=1,
        compression=codec,
        membership=membership,
        **_keywords(schedule),
    )
    if "uneven" in SCHEDULES[schedule]:
        opt.stop_at(STEPS)
    return opt


def _steps(opt, schedule):
    """The loop's condition: uneven ranks stop on the optimizer's word."""
    if "uneven" in SCHEDULES[schedule]:
        return lambda count: not opt.stopped
    return lambda count: count < STEPS


def fixed(rank, world_size):
    """Every schedule x codec on a fixed membership: ``{name: trace}``."""
    out = {}
    for schedule in SCHEDULES:
        for codec in CODECS:
            model = _live.model()
            params = list(model.parameters())
            opt = _optimizer(params, schedule, codec)
            going, count, trace = _steps(opt, schedule), 0, []
            while going(count):
                _live.loss(model, rank, count).backward()
                opt.step()
                opt.zero_grad()
                count += 1
                trace.append(record(opt, params, count))
            out[f"{schedule}/{codec}"] = trace
            del opt
    return out


def _store(path):
    import torch.distributed as dist

    return dist.FileStore(os.path.join(path, "store"), -1)


def _barrier(store, name, ids):
    import datetime

    for i in ids:
        store.wait([f"{name}/{i}"], datetime.timedelta(seconds=120))


def member(rank, world_size, path, schedule, codec):
    """A member of the kill-and-join run (module docstring); the victim returns nothing."""
    import datetime

    from decent_optim.gossip.membership import Membership

    store = _store(path)
    live = Membership(store, prefix="live", timeout=TIMEOUT)
    model = _live.model()
    params = list(model.parameters())
    opt = _optimizer(params, schedule, codec, live)
    going, count, trace = _steps(opt, schedule), 0, []
    while going(count):
        _live.loss(model, rank, count).backward()
        opt.step()
        opt.zero_grad()
        count += 1
        trace.append(record(opt, params, count))
        if os.environ.get("GOLDEN_DEBUG"):
            trace[-1].append([float(v) for p in params for v in p.detach().reshape(-1)])
        if count == KILL_AT:
            opt.synchronize()
            trace.append(["synchronized", *record(opt, params, count)[1:]])
            store.set(f"kill/{rank}", "")
            _barrier(store, "kill", range(4))
            if rank == VICTIM:
                os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)
            if rank == 0:  # a member starts the change, as one that noticed the loss does
                store.add("live/g0/change", 1)
            store.wait(["live/g0/change"], datetime.timedelta(seconds=120))
        if count == JOIN_AT:
            opt.synchronize()
            trace.append(["synchronized", *record(opt, params, count)[1:]])
            store.set(f"join/{rank}", "")
            _barrier(store, "join", (0, 1, 3))
            if rank == 0:
                store.set("go", "1")
            store.wait(["live/g1/change"], datetime.timedelta(seconds=120))
    final = [float(v) for p in params for v in p.detach().reshape(-1)]
    return {"trace": trace, "view": tuple(opt.membership), "final": final}


def newcomer(path, schedule, codec):
    """The worker that joins the run at :data:`JOIN_AT`: its trace from its construction on."""
    import datetime

    from decent_optim.gossip.membership import Membership

    store = _store(path)
    store.wait(["go"], datetime.timedelta(seconds=120))
    model = _live.model(seed=1)
    params = list(model.parameters())
    live = Membership(store, prefix="live", timeout=TIMEOUT, join=True)
    opt = _optimizer(params, schedule, codec, live)
    count = int(opt.state_dict()["decent_optim"]["step"])
    trace = [["joined", *record(opt, params, count)[1:]]]
    if os.environ.get("GOLDEN_DEBUG"):
        trace[-1].append([float(v) for p in params for v in p.detach().reshape(-1)])
    me = opt.membership.members[opt.membership.rank]
    going = _steps(opt, schedule)
    while going(count):
        _live.loss(model, me, count).backward()
        opt.step()
        opt.zero_grad()
        count += 1
        trace.append(record(opt, params, count))
        if os.environ.get("GOLDEN_DEBUG"):
            trace[-1].append([float(v) for p in params for v in p.detach().reshape(-1)])
    final = [float(v) for p in params for v in p.detach().reshape(-1)]
    return {"trace": trace, "view": tuple(opt.membership), "final": final}


def simulate(schedule, steps=STEPS, kill_at=KILL_AT, join_at=JOIN_AT, history=None, transfer=True):
    """The kill-and-join run of :func:`member` and :func:`newcomer` with ``local_steps=2`` and
    ``outer=`` (``"H2+diloco"`` or ``"H2+slow<K>"``), without the package: dense float64, the
    ring's mixing matrices on the members of each round, ``torch.optim.AdamW`` on each one's
    own gradients; the final parameters by member id (0, 1, 3, then the newcomer 4).
    ``transfer=False``: the newcomer starts its anchors, slow weights and outer momentum from
    its parameters, as before issue 62 (to show that what it receives matters)."""
    import torch

    from decent_optim import topologies

    H, diloco = 2, schedule == "H2+diloco"
    K = None if diloco else SCHEDULES[schedule]["outer"][1]["every"]
    lr, mu, nesterov = (0.7, 0.9, True) if diloco else (0.5, 0.7, True)
    net = _live.model()
    start = torch.nn.utils.parameters_to_vector(net.parameters()).detach()

    def fresh(x):
        p = torch.nn.Parameter(x.clone())
        return {
            "x": p,
            "opt": torch.optim.AdamW([p], lr=_live.LR, foreach=False),
            "a": x.clone(),
            "b": None,
            "theta": x.clone(),
            "sb": None,
            "pending": False,
        }

    def outer_step(theta, x, buf):  # torch.optim.SGD's, with the pseudo-gradient theta - x
        delta = theta - x
        buf = delta.clone() if buf is None else buf * mu + delta
        theta -= lr * (delta + mu * buf if nesterov else buf)
        x.copy_(theta)
        return buf

    def mix(members, ranks, k):
        w = topologies.get("ring", len(ranks)).mixing_matrix(k).double()
        mixed = w @ torch.stack([members[i]["a"] for i in ranks])
        with torch.no_grad():
            for row, i in zip(mixed, ranks):
                m = members[i]
                m["x"].add_(row - m["a"])
                m["a"], m["pending"] = row.clone(), False

    members = {i: fresh(start) for i in range(4)}
    group = [0, 1, 2, 3]  # the ids of the ranks, in rank order
    for c in range(steps):
        grads = {}
        for i in group:
            torch.nn.utils.vector_to_parameters(members[i]["x"].detach().clone(), net.parameters())
            net.zero_grad()
            _live.loss(net, i, c).backward()
            grads[i] = torch.cat([q.grad.reshape(-1) for q in net.parameters()])
        if (c + 1) % H == 0 and any(members[i]["pending"] for i in group):
            mix(members, group, c // H)  # the round launched at c + 1 - H
        for i in group:
            members[i]["x"].grad = grads[i]
            members[i]["opt"].step()
        with torch.no_grad():
            for i in group:
                m = members[i]
                if K is not None and (c + 1) % K == 0:
                    m["sb"] = outer_step(m["theta"], m["x"].data, m["sb"])
                if (c + 1) % H == 0:
                    if diloco:
                        m["b"] = outer_step(m["a"], m["x"].data, m["b"])
                    else:
                        m["a"] = m["x"].detach().clone()
        if c + 1 == join_at + 2:  # the newcomer: a copy of the source's (rank 0's) state
            source, new = members[0], fresh(start)
            new["x"].data.copy_(source["x"].data)
            # deep: load_state_dict would share the source's tensors of equal dtype and device
            new["opt"].load_state_dict(copy.deepcopy(source["opt"].state_dict()))
            for key in ("a", "b", "theta", "sb"):
                new[key] = None if source[key] is None else source[key].clone()
                if not transfer:
                    new[key] = new["x"].detach().clone() if key in ("a", "theta") else None
            members[4] = new
            group = [*group, 4]
        if (c + 1) % H == 0:  # the round of the anchors
            for i in group:
                members[i]["pending"] = True
            if diloco:
                mix(members, group, (c + 1) // H)
        if c + 1 in (kill_at, join_at) and any(members[i]["pending"] for i in group):
            mix(members, group, (c + 1) // H)  # synchronize()
        if history is not None:
            for i in group:
                history.setdefault(i, []).append(members[i]["x"].detach().clone())
        if c + 1 == kill_at:
            group = [i for i in group if i != VICTIM]
    return {i: members[i]["x"].detach() for i in group}

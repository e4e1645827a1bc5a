"""Live membership with ``uneven=True`` (issue 42): a worker lost while the others step unevenly.

Four gloo ranks train ``tests/_live.py``'s float64 model with DSGD (plain SGD steps) on the
ring, ``local_steps=2, uneven=True``, one rank slowed by a sleep per step, until a budget
(``opt.stop_at``; the loop ends on ``opt.stopped``). One rank is SIGKILLed mid-run, or
SIGSTOPped (hung: declared dead after the timeout); or three ranks are joined by a fourth
process (``start_alone``). Every rank records, from the step in which its group was rebuilt
(a newcomer: from its optimizer's construction), its parameters, and then per step whether it
launched or mixed a round. The test checks that every loop ended, that the views agree, and
replays the ranks from their parameters at the change in float64 -- the ring's mixing matrix
on 3 or 4 ranks, SGD on each one's own gradients, at the steps each one recorded -- written
from decent_optim.optim.uneven's docstring alone; it also checks that their sum moved by their
local updates only and that mixing kept them closer than training alone would.

The SIGKILL and the join run with ``outer=LocalOuterSGD(...)`` (issue 62): every rank also
records its slow weights and their momentum at the change (a survivor its own, a newcomer the
source's) and the steps that took the outer step; the replay takes torch.optim.SGD's Nesterov
step on them there, and the test checks that every rank took it at the same rounds, in steps
that mixed a round. Last, on three nodes of two ranks, the group rebuilt after a node is lost
still never waits for a node-mate at a launch (its gossipers are deferred, as the first one).
"""

from __future__ import annotations

import datetime
import os
import signal
import time

import _live
import pytest
import torch
from _harness import run_world_fresh, start_alone

from decent_optim.topologies import get as get_topology

TIMEOUT = 4.0  # seconds: the membership agreement's bound on each wait
LOCAL_STEPS, BUDGET, LR = 2, 80, 0.01
OUTER = dict(lr=0.5, momentum=0.7, every=8)  # LocalOuterSGD's: about 8 outer steps per run
SURVIVORS = (0, 1, 3)
FAULT_AT = 4  # the victim's step at which it is killed or stopped
JOIN_AT = 4  # rank 0's step after which the newcomer asks to join
WAIT = datetime.timedelta(seconds=120)  # for a key of the other side, under load


def _optimizer(model, live, patient, changes=None, outer=False):
    from decent_optim import DSGD, LocalOuterSGD

    return DSGD(
        model.parameters(),
        lr=LR,
        topology="ring",
        timeout=patient,
        local_steps=LOCAL_STEPS,
        uneven=True,
        membership=live,
        on_membership_change=None if changes is None else changes.append,
        outer=LocalOuterSGD(**OUTER) if outer else None,
    )


def _recorded(opt):
    """The rounds this rank launched so far and its slow weights and their momentum (flat;
    None where there are none yet), as its checkpoint records them."""
    entry = opt.state_dict()["decent_optim"]["local_steps"]

    def flat(key):
        saved = entry.get(key)
        return None if saved is None else _live.flat(saved[i] for i in sorted(saved))

    return entry["uneven"]["launched"], flat("slow"), flat("slow_momentum")


def _loop(opt, model, member, out, sleep=0.0, hook=None):
    """Train to the budget; from the step in which the group was rebuilt (or from the start:
    a newcomer sets ``out["steps"]``) record per step whether it mixed and launched a round
    and took the outer step, and sum the gradients of the steps after it."""
    params, steps = list(model.parameters()), out.get("steps")
    opt.stop_at(BUDGET)
    t = 0
    while not opt.stopped:
        if hook is not None:
            hook(t)
        time.sleep(sleep)
        _loss(model, member, t).backward()
        grad, before = _live.flat(p.grad for p in params), _live.flat(params)
        generation, mixed = opt.membership.generation, opt.round
        launched, slow, _ = _recorded(opt)
        opt.step()
        opt.zero_grad()
        now, slow_now, momentum = _recorded(opt)
        went = now if now != launched else None
        stepped = slow is not None and not torch.equal(slow, slow_now)  # the outer step
        if opt.membership.generation != generation:
            out["changed"] = {"x": _live.flat(params), "before": before, "round": opt.round}
            out["changed"].update(slow=slow_now, slow_before=slow, momentum=momentum)
            out["grads"] = torch.zeros_like(grad)
            # the change sets the rounds launched to the round; a launch in the same step
            went = opt.round + 1 if now > opt.round else None
            steps = out["steps"] = [(t, None, went, stepped)]
        elif steps is not None:
            out["grads"] += grad
            steps.append((t, opt.round if opt.round != mixed else None, went, stepped))
        t += 1
    out["final"], out["round"], out["progress"] = _live.flat(params), opt.round, opt.progress
    out["view"] = tuple(opt.membership)
    return out


def _membership(path, join=False):
    import torch.distributed as dist

    from decent_optim.gossip.membership import Membership

    store = dist.FileStore(os.path.join(path, "store"), -1)
    return store, Membership(store, prefix="live", timeout=TIMEOUT, join=join)


def _train(rank, world_size, path, victim, fault, patient, sleeps, outer=False):
    store, live = _membership(path)
    model, changes = _live.model(), []
    opt = _optimizer(model, live, patient, changes, outer)

    def fault_or_join(t):
        if rank == victim and t == FAULT_AT:
            if fault == signal.SIGSTOP:  # a survivor kills it once they are done
                with open(os.path.join(path, "victim"), "w") as f:
                    f.write(str(os.getpid()))
            os.kill(os.getpid(), fault)
        if victim is None and rank == 0 and t == JOIN_AT:
            store.set("go", "1")
            store.wait(["live/g0/change"], WAIT)  # the newcomer asked: noticed at a launch

    out = _loop(opt, model, rank, {}, sleeps[rank], fault_or_join)
    out["changes"] = [tuple(v) for v in changes]
    if fault == signal.SIGSTOP and rank == 0:
        with open(os.path.join(path, "victim")) as f:
            os.kill(int(f.read()), signal.SIGKILL)
    return out


def _newcomer(path, patient, outer=False):
    store, live = _membership(path, join=True)
    store.wait(["go"], WAIT)
    model = _live.model(seed=1)  # of other values: the state comes from the source
    opt = _optimizer(model, live, patient, outer=outer)
    out = {"changed": {"x": _live.flat(model.parameters()), "round": opt.round}}
    _, slow, momentum = _recorded(opt)  # received from the source
    out["changed"].update(slow=slow, momentum=momentum)
    out["grads"] = torch.zeros_like(out["changed"]["x"])
    out["steps"] = [(None, None, None, False)]
    out["changes"] = [tuple(opt.membership)]  # no callback on a newcomer: its view on entry
    return _loop(opt, model, opt.membership.members[opt.membership.rank], out)


def _loss(model, member, t):
    """``_live.loss`` with targets shifted by the member id: workers whose optima differ, so
    that training alone drives them apart, and gossip must keep them together."""
    gen = torch.Generator().manual_seed(1000 * member + t)
    x = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    y = torch.randn(5, 2, generator=gen, dtype=torch.float64) + member
    return torch.nn.functional.mse_loss(model(x), y)


def _gradient(net, x, member, t):
    torch.nn.utils.vector_to_parameters(x.clone(), net.parameters())
    net.zero_grad()
    _loss(net, member, t).backward()
    return _live.flat(p.grad for p in net.parameters())


def _outer_step(theta, x, buf):
    """torch.optim.SGD's Nesterov step on the slow weights with the pseudo-gradient theta - x."""
    lr, mu = OUTER["lr"], OUTER["momentum"]
    delta = theta - x
    buf = delta.clone() if buf is None else mu * buf + delta
    return theta - lr * (delta + mu * buf), buf


def _replay(runs, members):
    """The survivors from their parameters at the change, in float64: at each recorded step the
    gradient at the unmixed parameters, the mix ``x_i += sum_j w_ij a_j - a_i`` of the round
    it mixed, the SGD step, the outer step ``x_i = theta_i`` where it took one, and
    ``a_i = x_i`` when it launched a round."""
    topo, net = get_topology("ring", len(runs)), _live.model()
    x = [r["changed"]["x"].clone() for r in runs]
    slow = [(r["changed"].get("slow"), r["changed"].get("momentum")) for r in runs]
    todo = [list(r["steps"]) for r in runs]
    anchors: dict[int, list] = {}
    mixes: dict[int, torch.Tensor] = {}

    def step(i, t, mixed, went, stepped, first):
        if not first:  # the step of the change is in x already
            g = _gradient(net, x[i], members[i], t)
            if mixed is not None:
                x[i] = x[i] + mixes[mixed][i] - anchors[mixed][i]
            x[i] = x[i] - LR * g
            if stepped:
                theta, buf = _outer_step(slow[i][0], x[i], slow[i][1])
                slow[i], x[i] = (theta, buf), theta.clone()
        if went is not None:
            anchors.setdefault(went, [None] * len(runs))[i] = x[i].clone()

    first = [True] * len(runs)
    while any(todo):
        moved = False
        for i, left in enumerate(todo):
            while left and (left[0][1] is None or left[0][1] in mixes):
                step(i, *left.pop(0), first[i])
                first[i], moved = False, True
        for k, sent in anchors.items():
            if k not in mixes and all(a is not None for a in sent):
                mixes[k] = topo.mixing_matrix(k).double() @ torch.stack(sent)
                moved = True
        assert moved, ("no survivor can go on: a round mixed before all launched it", runs)
    return x, sorted(mixes)


def _spread(xs):
    stack = torch.stack(xs)
    return float(((stack - stack.mean(0)) ** 2).sum(1).mean())


def _check(runs, members, lost, outer=False):
    """``runs`` by new rank, of the ``members`` (ids) of generation 1, ``lost`` the ids lost."""
    for new_rank, run in enumerate(runs):
        view = (1, members, new_rank, lost)
        assert run["view"] == view and run["changes"] == [view], (run["view"], run["changes"])
        # the budget: S / n' + H reached it at the last round (module docstring)
        assert run["progress"] >= BUDGET - LOCAL_STEPS + 1, run["progress"]
    # every survivor went on at the same round and stopped after the same round
    assert len({r["changed"]["round"] for r in runs}) == 1, [r["changed"] for r in runs]
    assert len({r["round"] for r in runs}) == 1, [r["round"] for r in runs]
    want, mixed = _replay(runs, members)
    start = runs[0]["changed"]["round"]
    assert mixed == list(range(start + 1, runs[0]["round"] + 1)), mixed
    assert len(mixed) >= 3, f"too few rounds after the change for the test to say much: {mixed}"
    for run, x in zip(runs, want):
        torch.testing.assert_close(run["final"], x, rtol=0, atol=1e-10)
    if outer:  # every rank took the outer step at the same rounds, in steps that mixed one
        rounds = [[m for _, m, _, stepped in r["steps"][1:] if stepped] for r in runs]
        assert all(r == rounds[0] for r in rounds) and None not in rounds[0], rounds
        assert len(rounds[0]) >= 2, f"too few outer steps after the change: {rounds}"
        return  # the outer steps move the sum and the spread: the replay is the check
    # gossip keeps the survivors' sum: it moved by their SGD steps only
    moved = sum(r["final"] for r in runs) - sum(r["changed"]["x"] for r in runs)
    torch.testing.assert_close(moved, -LR * sum(r["grads"] for r in runs), rtol=0, atol=1e-10)
    # and kept them closer than the same steps without mixing (torch.optim.SGD alone)
    alone = []
    for member, run in zip(members, runs):
        net = _live.model()
        torch.nn.utils.vector_to_parameters(run["changed"]["x"].clone(), net.parameters())
        sgd = torch.optim.SGD(net.parameters(), lr=LR)
        for t, *_ in run["steps"][1:]:
            sgd.zero_grad()
            _loss(net, member, t).backward()
            sgd.step()
        alone.append(_live.flat(net.parameters()))
    together, apart = _spread([r["final"] for r in runs]), _spread(alone)
    assert together < 0.5 * apart, (together, apart)


# rank 2 is SIGKILLed at its step 4 while rank 1 is slow, the ranks taking the outer step on
# their slow weights (issue 62); or rank 2 is slow, then stops (SIGSTOP: hung) at its step 4 and
# is declared dead after the optimizer's timeout of 5 s (no outer step)
FAULTS = {
    "killed+outer": (signal.SIGKILL, 30.0, (0.0, 0.03, 0.0, 0.0), True),
    "slow-then-hung": (signal.SIGSTOP, 5.0, (0.0, 0.0, 0.03, 0.0), False),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("fault", FAULTS)
def test_survivors_of_a_lost_rank_finish_as_the_dense_replay(fault, tmp_path):
    """With ``outer=``: each survivor keeps its own slow weights, and all take the outer step
    at the same rounds."""
    signum, patient, sleeps, outer = FAULTS[fault]
    args = (str(tmp_path), 2, signum, patient, sleeps, outer)
    results = run_world_fresh(_train, 4, *args, timeout=120, killed=(2,))
    assert results[2] is None, results[2]
    _check([results[m] for m in SURVIVORS], SURVIVORS, (2,), outer)


@pytest.mark.multiprocess
def test_a_newcomer_joins_uneven_ranks_and_all_finish_as_the_dense_replay(tmp_path):
    """With ``outer=`` (issue 62): the newcomer receives the source's slow weights and their
    momentum, and takes the outer step at the members' rounds."""
    path = str(tmp_path)
    alone = start_alone(_newcomer, path, 30.0, True)  # asks to join after rank 0's step 4
    try:
        members = run_world_fresh(
            _train, 3, path, None, None, 30.0, (0.0, 0.03, 0.0), True, timeout=120
        )
    finally:
        newcomer = alone.result(timeout=120)
    _check([*members, newcomer], (0, 1, 2, 3), (), outer=True)
    # the newcomer took the source's (new rank 0's) state, at the step in which it rebuilt
    source = members[0]["changed"]
    assert any(torch.equal(newcomer["changed"]["x"], source[k]) for k in ("before", "x"))
    assert any(torch.equal(newcomer["changed"]["slow"], source[k]) for k in ("slow_before", "slow"))


def _mate_pauses(rank, world_size, path, pause):
    """Three nodes of two ranks; node 2 dies at its step 4 (both ranks), then rank 1 sleeps
    ``pause`` seconds in one step: returns when each step ended, and the pause."""
    from decent_optim import DSGD, Uneven

    _, live = _membership(path)
    model = _live.model()
    opt = DSGD(
        model.parameters(),
        lr=LR,
        topology="complete",  # its round is one group: exchanged node by node
        local_world_size=2,
        timeout=30.0,
        local_steps=LOCAL_STEPS,
        uneven=Uneven(cap=None),  # no wait for a round at all
        membership=live,
    )
    opt.stop_at(BUDGET)
    ends, paused, t = [], None, 0
    while not opt.stopped:
        if rank >= 4 and t == FAULT_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        # once the group is the two whole nodes left (the victims may be lost in one change or
        # in two, as the survivors notice them)
        if rank == 1 and paused is None and opt.membership.world_size == 4:
            start = time.time()
            time.sleep(pause)
            paused = (start, time.time())
        else:
            time.sleep(0.002)
        _loss(model, rank, t).backward()
        opt.step()
        opt.zero_grad()
        ends.append(time.time())
        t += 1
    return ends, paused, tuple(opt.membership)


@pytest.mark.multiprocess
def test_after_a_change_no_step_waits_for_a_node_mate(tmp_path):
    """The group rebuilt at a change gossips as the first one: node rounds that never wait for
    a node-mate at a launch (the gossipers of uneven=True are deferred)."""
    runs = run_world_fresh(_mate_pauses, 6, str(tmp_path), 3.0, timeout=120, killed=(4, 5))
    assert runs[4] is None and runs[5] is None, runs[4:]
    views = [r[2] for r in runs[:4]]
    assert [v[1:3] for v in views] == [((0, 1, 2, 3), k) for k in range(4)], views
    start, end = runs[1][1]
    during = sum(start < t < end for t in runs[0][0])
    # a launch that waited for its node-mate would stop rank 0 at its next launch
    assert during >= 10, f"rank 0 took {during} steps while its node-mate slept"

"""Live membership in the optimizer (issue 42, stage 2): a rank dies, the others' step() returns.

Four gloo ranks train a small float64 model with DecentralizedAdamW on the ring; rank 2
SIGKILLs itself before its step ``KILL_AT``. Each survivor records, after the step in which its
group was rebuilt, its step count, parameters and Adam state; the test then runs an independent
dense float64 simulation from there -- the ring's mixing matrices on 3 ranks and
``torch.optim.AdamW`` on each survivor's own gradients -- and compares the final parameters.
The survivors notice the loss at different steps; gossip resumes at the largest of their counts
(docs: decent_optim.optim.live), which the simulation follows.
"""

from __future__ import annotations

import os
import signal

import _live
import pytest
import torch
from _harness import run_world, run_world_fresh

TIMEOUT = 3.0  # seconds: the membership agreement's bound on each wait
PATIENT = 30.0  # the optimizer's timeout: a loss is noticed by a closed connection or the store
KILL_AT, VICTIM = 4, 2
STEPS, LR = _live.STEPS, _live.LR


def _train(rank, world_size, path, local_steps, victim, membership=True):
    import torch.distributed as dist

    from decent_optim import DecentralizedAdamW
    from decent_optim.gossip.membership import Membership

    live = None
    if membership:
        store = dist.FileStore(os.path.join(path, "store"), -1)
        live = Membership(store, prefix="live", timeout=TIMEOUT)
    model, changes = _live.model(), []
    opt = DecentralizedAdamW(
        model.parameters(),
        lr=LR,
        topology="ring",
        timeout=PATIENT,
        local_steps=local_steps,
        membership=live,
        on_membership_change=changes.append if membership else None,
    )
    params, out = list(model.parameters()), {}
    for t in range(STEPS):
        if t == KILL_AT and rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        _live.loss(model, rank, t).backward()
        generation = opt.membership.generation if membership else 0
        opt.step()
        opt.zero_grad()
        if membership and opt.membership.generation != generation:
            state = [opt.state[p] for p in params]
            out["changed"] = {
                "count": t + 1,
                "x": _live.flat(params),
                "m": _live.flat(s["exp_avg"] for s in state),
                "v": _live.flat(s["exp_avg_sq"] for s in state),
                "step": int(state[0]["step"]),
            }
    out["final"] = _live.flat(params)
    if membership:
        out["view"], out["changes"] = tuple(opt.membership), [tuple(v) for v in changes]
        sizes = (opt.world_size, opt.rank, opt.membership.world_size, opt.topology.world_size)
        out["world_size"] = sizes
    return out


def _check_against_simulation(results, local_steps):
    survivors = [r for r in range(4) if r != VICTIM]
    assert results[VICTIM] is None, results
    starts = [results[r]["changed"] for r in survivors]
    resume = max(s["count"] for s in starts)
    assert resume <= STEPS - 2 * local_steps, starts  # rounds were mixed after the change
    assert all(s["count"] % local_steps == 0 for s in starts), starts
    expected = _live.simulate(starts, survivors, local_steps)
    for r, want in zip(survivors, expected):
        torch.testing.assert_close(results[r]["final"], want, rtol=0, atol=1e-10)
    # the run differs from one without any mixing after the change
    alone = [_live.simulate([s], [r], local_steps)[0] for s, r in zip(starts, survivors)]
    assert any(not torch.allclose(a, e, atol=1e-6) for a, e in zip(alone, expected))


@pytest.fixture(scope="module")
def killed_every_step(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("live"))
    return run_world_fresh(_train, 4, path, 1, VICTIM, timeout=90, killed=(VICTIM,))


@pytest.mark.multiprocess
def test_survivors_train_on_as_the_dense_simulation(killed_every_step):
    _check_against_simulation(killed_every_step, local_steps=1)


@pytest.mark.multiprocess
def test_survivors_train_on_with_local_steps(tmp_path):
    results = run_world_fresh(_train, 4, str(tmp_path), 2, VICTIM, timeout=90, killed=(VICTIM,))
    _check_against_simulation(results, local_steps=2)


@pytest.mark.multiprocess
def test_membership_reports_the_change_and_calls_back(killed_every_step):
    survivors = (0, 1, 3)
    for new_rank, old in enumerate(survivors):
        out = killed_every_step[old]
        view = (1, survivors, new_rank, (VICTIM,))
        assert out["view"] == view, out["view"]
        assert out["changes"] == [view], out["changes"]
        assert out["world_size"] == (3, new_rank, 3, 3), out["world_size"]


def _with_and_without(rank, world_size, path):
    import gc

    out = {}
    for local_steps in (1, 2):
        live = _train(rank, world_size, path, local_steps, victim=None)
        gc.collect()  # the first optimizer's slot is free again: the second gets the same channel
        plain = _train(rank, world_size, path, local_steps, victim=None, membership=False)
        out[local_steps] = live["final"], plain["final"], live["view"]
    return out


@pytest.mark.multiprocess
def test_membership_without_a_fault_changes_nothing(tmp_path):
    results = run_world(_with_and_without, 4, str(tmp_path), timeout=90)
    for local_steps in (1, 2):
        for rank, out in enumerate(results):
            live, plain, view = out[local_steps]
            assert torch.equal(live, plain), (local_steps, rank, live, plain)
            assert view == (0, (0, 1, 2, 3), rank, ()), view
        # the ranks trained on their own data
        assert not torch.equal(results[0][local_steps][0], results[1][local_steps][0])


def _refusals(rank, world_size, path):
    import torch.distributed as dist

    from decent_optim import DecentralizedAdamW, topologies
    from decent_optim.gossip.membership import Membership

    live = Membership(dist.FileStore(os.path.join(path, "store"), -1), timeout=TIMEOUT)
    model = _live.model()
    # (outer= with membership= is supported with every cadence since issue 62, uneven=True too:
    # test_live_uneven_outer.py)
    cases = {
        "process_group": dict(process_group=dist.group.WORLD),
        "topology": dict(topology=topologies.get("ring", world_size)),
    }
    said = {}
    for name, kwargs in cases.items():
        try:
            DecentralizedAdamW(model.parameters(), membership=live, **kwargs)
        except ValueError as err:
            said[name] = str(err)
    try:
        DecentralizedAdamW(model.parameters(), membership=object())
    except TypeError as err:
        said["object"] = str(err)
    try:
        DecentralizedAdamW(model.parameters(), on_membership_change=print)
    except ValueError as err:
        said["callback"] = str(err)
    return said


@pytest.mark.multiprocess
def test_unsupported_settings_are_refused_at_construction(tmp_path):
    for said in run_world(_refusals, 4, str(tmp_path)):
        assert set(said) == {"process_group", "topology", "object", "callback"}, said
        for name in ("process_group", "topology"):
            assert "membership= supports local_steps=1" in said[name], said[name]
            assert name in said[name], said[name]
        assert "Membership(store" in said["object"] and "needs membership=" in said["callback"]


def test_the_topology_after_a_change_fits_the_survivors():
    from decent_optim.gossip.membership import View
    from decent_optim.optim.live import topology_for

    # one worker of a node of 4 lost: the survivors no longer fill nodes, each is a node
    topo = topology_for("ring", View(1, (0, 1, 3), 2, (2,)), 4)
    assert (topo.world_size, topo.local_world_size) == (3, 1)
    # a whole node of 2 lost: the other node stays a node
    topo = topology_for("ring", View(1, (0, 1), 1, (2, 3)), 2)
    assert (topo.world_size, topo.local_world_size) == (2, 2)
    # one-peer-exp needs a power of two: ring instead, said in a warning
    with pytest.warns(UserWarning, match='gossip with topology="ring" instead'):
        topo = topology_for("one-peer-exp", View(1, (0, 1, 3), 2, (2,)), 1)
    assert type(topo).__name__ == "RingTopology" and topo.world_size == 3

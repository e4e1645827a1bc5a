"""Live membership, joining (issue 42, stage 3): a worker started while the job runs joins it.

Three gloo ranks train a small float64 model with DecentralizedAdamW on the ring; a fourth
process, started beside them outside any process group (``start_alone``) with a model of other
values, waits until rank 0 has taken ``JOIN_AT`` steps (a store key) and then builds its
optimizer with ``Membership(store, join=True)``; rank 0 waits for its request, so the join
lands early in the run. Each member records its state after the step in which its group was
rebuilt, the newcomer right after its optimizer was built; the test then runs an independent
dense float64 simulation from there -- the ring's mixing matrices on 4 ranks and
``torch.optim.AdamW`` on each rank's own gradients -- and compares the final parameters.
"""

from __future__ import annotations

import datetime
import os
import signal

import _live
import pytest
import torch
from _harness import run_world, run_world_fresh, start_alone

TIMEOUT = 3.0  # seconds: the membership agreement's bound on each wait
PATIENT = 30.0  # the optimizer's timeout: a loss is noticed by a closed connection or the store
JOIN_AT = 4
STEPS, LR = _live.STEPS, _live.LR
WAIT = datetime.timedelta(seconds=120)  # for a key of the other side, under load


def _record(opt, params, count):
    state = [opt.state[p] for p in params]
    return {
        "count": count,
        "x": _live.flat(params),
        "m": _live.flat(s["exp_avg"] for s in state),
        "v": _live.flat(s["exp_avg_sq"] for s in state),
        "step": int(state[0]["step"]),
    }


def _store(path):
    import torch.distributed as dist

    return dist.FileStore(os.path.join(path, "store"), -1)


def _member(rank, world_size, path, local_steps, kill=None, second=None):
    from decent_optim import DecentralizedAdamW
    from decent_optim.gossip.membership import Membership

    store = _store(path)
    live = Membership(store, prefix="live", timeout=TIMEOUT)
    model, changes = _live.model(), []
    opt = DecentralizedAdamW(
        model.parameters(),
        lr=LR,
        topology="ring",
        timeout=PATIENT,
        local_steps=local_steps,
        membership=live,
        on_membership_change=changes.append,
    )
    params, out = list(model.parameters()), {}
    for t in range(STEPS):
        if kill is not None and (rank, t) == kill:
            os.kill(os.getpid(), signal.SIGKILL)
        _live.loss(model, rank, t).backward()
        generation = opt.membership.generation
        opt.step()
        opt.zero_grad()
        if opt.membership.generation != generation and "changed" not in out:
            out["changed"] = _record(opt, params, t + 1)
        if rank == 0 and t + 1 == JOIN_AT:
            store.set("go", "1")
            store.wait(["live/g0/change"], WAIT)  # the newcomer asked: noticed at the next round
        if rank == 0 and t + 1 == second:  # a second newcomer, after the first joined
            store.set("go2", "1")
            store.wait(["live/g1/change"], WAIT)
    out["final"], out["view"] = _live.flat(params), tuple(opt.membership)
    out["changes"] = [tuple(v) for v in changes]
    _consensus(opt, params, out)
    return out


def _consensus(opt, params, out):
    """The optimizer's collectives on the group as it is now (after the changes)."""
    out["distance"] = opt.consensus_distance()
    with opt.averaged():
        out["averaged"] = _live.flat(params)
    opt.synchronize()  # mixes the last round, launched at the end of the last step
    out["synced"] = _live.flat(params)


def _newcomer(path, local_steps, width=2, go="go"):
    from decent_optim import DecentralizedAdamW
    from decent_optim.gossip.membership import Membership

    store = _store(path)
    store.wait([go], WAIT)
    model = _live.model(seed=1, width=width)  # a fresh model, of other values
    params = list(model.parameters())
    out = {"before": _live.flat(params)}
    live = Membership(store, prefix="live", timeout=TIMEOUT, join=True)
    try:
        opt = DecentralizedAdamW(
            params,
            lr=LR,
            topology="ring",
            timeout=PATIENT,
            local_steps=local_steps,
            membership=live,
        )
    except ValueError as err:
        return {"refused": str(err)}
    count = int(opt.state[params[0]]["step"])
    out["joined"], out["first_view"] = _record(opt, params, count), tuple(opt.membership)
    try:  # a second join of this process (issue 64: it was told not to init_process_group)
        Membership(store, prefix="live", timeout=TIMEOUT, join=True)
    except RuntimeError as err:
        out["again"] = str(err)
    _live.train(model, opt, opt.membership.members[opt.membership.rank], count)
    out["final"], out["view"] = _live.flat(params), tuple(opt.membership)
    out["sizes"] = (opt.world_size, opt.rank, opt.topology.world_size)
    _consensus(opt, params, out)
    return out


def _check_consensus(outs):
    """``averaged()`` and ``consensus_distance()`` over the current members: their mean."""
    mean = torch.stack([out["final"] for out in outs]).mean(0)
    for out in outs:
        torch.testing.assert_close(out["averaged"], mean, rtol=0, atol=1e-12)
        want = float(torch.linalg.vector_norm(out["final"] - mean))
        assert abs(out["distance"] - want) <= 1e-9 * (1 + want), (out["distance"], want)


def _run(path, local_steps, kill=None, width=2, second=None):
    alone = start_alone(_newcomer, path, local_steps, width)
    other = None if second is None else start_alone(_newcomer, path, local_steps, 4, "go2")
    killed = () if kill is None else (kill[0],)
    try:
        members = run_world_fresh(
            _member, 3, path, local_steps, kill, second, timeout=180, killed=killed
        )
    finally:
        newcomer = alone.result(timeout=120)
        refused = None if other is None else other.result(timeout=120)
    return (members, newcomer) if other is None else (members, newcomer, refused)


def _check(members, newcomer, local_steps):
    from decent_optim import topologies

    joined, source = newcomer["joined"], members[0]["changed"]
    # (b) the newcomer holds exactly the source's (new rank 0's) state, not its own
    assert joined["count"] == source["count"] and joined["step"] == source["step"], joined
    for key in ("x", "m", "v"):
        assert torch.equal(joined[key], source[key]), key
    assert not torch.allclose(newcomer["before"], joined["x"])
    # (a) one view on all 4: generation 1, the newcomer (id 3) last
    view = (1, (0, 1, 2, 3), 3, ())
    assert newcomer["first_view"] == view and newcomer["view"] == view, newcomer["view"]
    assert newcomer["sizes"] == (4, 3, 4), newcomer["sizes"]
    again = newcomer["again"]
    assert "this process is in the running job already (live membership built its group" in again
    assert "a process joins once" in again and "init_process_group" not in again, again
    for rank, out in enumerate(members):
        assert out["view"] == (1, (0, 1, 2, 3), rank, ()), out["view"]
        assert out["changes"] == [out["view"]], out["changes"]
    # (c) the 4 ranks from the join on are the dense simulation
    starts = [out["changed"] for out in members] + [joined]
    resume = max(s["count"] for s in starts)
    assert resume <= STEPS - 2 * local_steps, starts  # rounds were mixed after the join
    assert all(s["count"] % local_steps == 0 for s in starts), starts
    finals = [out["final"] for out in members] + [newcomer["final"]]
    expected = _live.simulate(starts, [0, 1, 2, 3], local_steps)
    for rank, (got, want) in enumerate(zip(finals, expected)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10, msg=f"rank {rank}")
    # the newcomer was mixed with: a run where it trains alone ends elsewhere
    alone = _live.simulate([joined], [3], local_steps)[0]
    assert not torch.allclose(alone, newcomer["final"], atol=1e-6)
    _check_consensus([*members, newcomer])
    # synchronize() on the new group: the round launched at the end mixed into the finals
    w = topologies.get("ring", 4).mixing_matrix(STEPS // local_steps).double()
    synced = w @ torch.stack(finals)
    for rank, out in enumerate([*members, newcomer]):
        torch.testing.assert_close(out["synced"], synced[rank], rtol=0, atol=1e-12)


@pytest.mark.multiprocess
def test_a_newcomer_joins_and_trains_as_the_dense_simulation(tmp_path):
    _check(*_run(str(tmp_path), 1), local_steps=1)


@pytest.mark.multiprocess
def test_a_newcomer_joins_with_local_steps(tmp_path):
    _check(*_run(str(tmp_path), 2), local_steps=2)


@pytest.mark.multiprocess
def test_a_join_a_refused_newcomer_and_a_kill(tmp_path):
    """One run: a newcomer joins after step 4, a second one, built with another model, asks
    after step 7 and is refused, rank 1 is SIGKILLed before its step 11; no hang."""
    members, newcomer, refused = _run(str(tmp_path), 1, kill=(1, 11), second=7)
    said = refused["refused"]
    assert "differs from the running members'" in said and "join again" in said, said
    # it names the part that differs (a Linear(3, 4) among Linear(3, 2)), and only that one
    assert "in the parameters' shapes, dtypes or order ([(0, 'torch.float64', [(4, 3)" in said
    assert "schedule" not in said and "topology" not in said, said
    assert members[1] is None
    # generation 1 took id 3 in, 2 took id 4 in, 3 dropped it (refused), 4 dropped id 1
    views = [(1, (0, 1, 2, 3)), (2, (0, 1, 2, 3, 4)), (3, (0, 1, 2, 3)), (4, (0, 2, 3))]
    for rank, out in ((0, members[0]), (1, members[2]), (2, newcomer)):
        assert out["view"] == (4, (0, 2, 3), rank, (1,)), out["view"]
    for out in (members[0], members[2]):
        assert [(v[0], v[1]) for v in out["changes"]] == views, out["changes"]
        assert [v[3] for v in out["changes"]] == [(), (), (4,), (1,)], out["changes"]
    assert newcomer["sizes"] == (3, 2, 3)
    for out in (members[0], members[2], newcomer):
        assert torch.isfinite(out["final"]).all()
    _check_consensus([members[0], members[2], newcomer])


def _refusals(rank, world_size, path):
    import torch.distributed as dist

    from decent_optim import DecentralizedAdamW
    from decent_optim.gossip.membership import Membership

    said = {}
    try:  # a process of the group cannot join it
        Membership(_store(path), prefix="live", join=True)
    except RuntimeError as err:
        said["initialized"] = str(err)
    live = Membership(_store(path), prefix="live", timeout=TIMEOUT)
    live.joining = True  # as a newcomer's, for the settings' checks before anything is sent
    # (outer= with membership= is supported with every cadence since issue 62, uneven=True too:
    # test_live_uneven_outer.py)
    for name, kwargs in {"process_group": dict(process_group=dist.group.WORLD)}.items():
        try:
            DecentralizedAdamW(_live.model().parameters(), membership=live, **kwargs)
        except ValueError as err:
            said[name] = str(err)
    return said


@pytest.mark.multiprocess
def test_joining_refusals(tmp_path):
    import torch.distributed as dist

    from decent_optim.gossip.membership import Membership

    said = run_world(_refusals, 1, str(tmp_path))[0]
    assert "join=True) is for a process outside the running group" in said["initialized"]
    assert "membership= supports local_steps=1" in said["process_group"], said
    assert not dist.is_initialized()  # this process is in no group: it may join, not be a member
    with pytest.raises(RuntimeError, match="pass join=True in a process that joins"):
        Membership(dist.FileStore(os.path.join(str(tmp_path), "alone"), -1), timeout=TIMEOUT)


def test_the_settings_check_of_a_newcomer_covers_every_part():
    """``joining.fit``: a newcomer whose ``Uneven(cap=...)``, outer step, ``local_steps`` or
    ``global_avg_every`` differ from the members' differs in the part that names it; the same
    settings are the same parts (issue 62: the cap and the outer step were not compared)."""
    from decent_optim import DecentralizedAdamW, LocalOuterSGD, Uneven
    from decent_optim.optim import joining

    def parts(**kw):
        model = _live.model()
        return dict(joining.fit(DecentralizedAdamW(model.parameters(), lr=LR, **kw)))

    members = parts(local_steps=2, uneven=Uneven(cap=8))
    assert parts(local_steps=2, uneven=Uneven(cap=8)) == members
    schedule = "the schedule (local_steps, outer=, uneven=)"
    for other in (
        dict(local_steps=2, uneven=Uneven(cap=2)),
        dict(local_steps=2, uneven=Uneven(cap=8, adaptive=False)),
        dict(local_steps=2, uneven=Uneven(cap=8), outer=LocalOuterSGD(every=4)),
        dict(local_steps=4, uneven=Uneven(cap=8)),
        dict(local_steps=2),
    ):
        theirs = parts(**other)
        assert [k for k in members if members[k] != theirs[k]] == [schedule], other
    slow = parts(local_steps=2, outer=LocalOuterSGD(every=4))
    assert parts(local_steps=2, outer=LocalOuterSGD(every=8))[schedule] != slow[schedule]
    assert parts(local_steps=2, outer="diloco")[schedule] != slow[schedule]
    pga = parts(global_avg_every=4)
    assert [k for k in pga if pga[k] != parts()[k]] == ["global_avg_every"]

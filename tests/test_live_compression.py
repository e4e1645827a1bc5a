"""Live membership with compressed gossip (issue 42): after a change the public copies start over.

Four gloo ranks (every rank a node of its own, ``local_world_size=1``: every pair of the ring is
compressed) train the small float64 model of ``_live`` with a codec, and rank 2 SIGKILLs itself
before its step ``KILL_AT``; or three do, and a fourth process joins after step ``JOIN_AT``. The
survivors (and the newcomer) build the gossiper of the new ring with the same codec and no
public copies, so each new pair's first round sends exact values, on every member alike.

* int8: an independent dense float64 simulation of CHOCO gossip -- the ring's pairs on the new
  world, each keeping its two public copies, int8 quantization of the differences written out
  here -- with ``torch.optim.AdamW`` on each rank's gradients reproduces the final parameters,
  after a kill and after a join (where the newcomer starts from the source's exact state).
* ``"top10%+int4"`` (a sparse codec, not written out here): with plain SGD, every step after
  the change leaves the survivors' sum unchanged apart from the local updates
  (:math:`\\sum_i x_i^+ + \\eta g_i = \\sum_i x_i`), and rounds without local updates shrink their
  distance to the mean. In the same run, before the kill, a newcomer built with another codec
  asks to join and is refused.
"""

from __future__ import annotations

import datetime
import os
import signal

import _live
import pytest
import torch
from _harness import run_world_fresh, start_alone

from decent_optim import topologies

TIMEOUT = 3.0  # seconds: the membership agreement's bound on each wait
PATIENT = 30.0  # the optimizer's timeout: a loss is noticed by a closed connection or the store
KILL_AT, VICTIM, JOIN_AT, REFUSED_AT = 4, 2, 4, 2
STEPS, LR = _live.STEPS, _live.LR
GOSSIP_ONLY = 12  # steps with lr=0 after STEPS (the sparse codec's test): rounds and nothing else
WAIT = datetime.timedelta(seconds=120)  # for a key of the other side, under load


def _store(path):
    import torch.distributed as dist

    return dist.FileStore(os.path.join(path, "store"), -1)


def _optimizer(params, compression, sgd, membership):
    return _live.ring(params, compression, membership, sgd=sgd, timeout=PATIENT)


def _record(opt, params, count, sgd):
    out = {"count": count, "x": _live.flat(params)}
    if not sgd:
        state = [opt.state[p] for p in params]
        out["m"] = _live.flat(s["exp_avg"] for s in state)
        out["v"] = _live.flat(s["exp_avg_sq"] for s in state)
        out["step"] = int(state[0]["step"])
    return out


def _member(rank, world_size, path, compression, kill, join, sgd=False):
    from decent_optim.gossip.membership import Membership

    store = _store(path)
    model = _live.model()
    params = list(model.parameters())
    opt = _optimizer(params, compression, sgd, Membership(store, prefix="live", timeout=TIMEOUT))
    out = {"steps": []}
    for t in range(STEPS + (GOSSIP_ONLY if sgd else 0)):
        if kill and (rank, t) == (VICTIM, KILL_AT):
            os.kill(os.getpid(), signal.SIGKILL)
        if t == STEPS:
            out["trained"] = _live.flat(params)
            for group in opt.param_groups:
                group["lr"] = 0.0
        before = _live.flat(params)
        _live.loss(model, rank, t).backward()
        grad = _live.flat(p.grad for p in params)
        generation = opt.membership.generation
        opt.step()
        opt.zero_grad()
        out["steps"].append((before, grad, _live.flat(params)))
        if opt.membership.generation != generation:  # the last change
            out["changed"] = _record(opt, params, t + 1, sgd)
        if rank == 0 and t + 1 == join:
            store.set("go", "1")
            store.wait(["live/g0/change"], WAIT)  # the newcomer asked: noticed at the next round
    out["final"], out["view"] = _live.flat(params), tuple(opt.membership)
    return out


def _refused(path, compression):
    """A newcomer (DSGD) whose codec differs from the members': the ValueError it gets."""
    from decent_optim.gossip.membership import Membership

    store = _store(path)
    store.wait(["go"], WAIT)
    live = Membership(store, prefix="live", timeout=TIMEOUT, join=True)
    try:
        _optimizer(list(_live.model().parameters()), compression, True, live)
    except ValueError as err:
        return str(err)
    return None


def _newcomer(path, compression):
    from decent_optim.gossip.membership import Membership

    store = _store(path)
    store.wait(["go"], WAIT)
    model = _live.model(seed=1)  # other values than the members'
    params = list(model.parameters())
    live = Membership(store, prefix="live", timeout=TIMEOUT, join=True)
    opt = _optimizer(params, compression, False, live)
    count = int(opt.state[params[0]]["step"])
    out = {"joined": _record(opt, params, count, False)}
    _live.train(model, opt, opt.membership.members[opt.membership.rank], count)
    out["final"], out["view"] = _live.flat(params), tuple(opt.membership)
    return out


def _int8(d):
    """int8 quantization of a difference of at most 1024 values (one chunk): ``round(d / s)``
    with the scale ``s = max |d| / 127`` stored as float32, decoded as ``q * s``."""
    scale = (d.abs().max() / 127).to(torch.float32).double()
    if scale == 0:
        return torch.zeros_like(d)
    return (d * (1 / scale)).round().clamp(-127, 127) * scale


class _Choco:
    """CHOCO gossip on the ring's pairs of ``n`` ranks, in float64, each pair from new public
    copies: ``mix(k, sent)`` is round ``k``. A pair's first round sends exact values; later,
    each member adds ``Q(x_a - c_a)`` to its copy ``c_a``; both hold ``x_a + (c_b - c_a) / 2``."""

    def __init__(self, n, quantize):
        self.topology, self.quantize, self.copies = topologies.get("ring", n), quantize, {}

    def __call__(self, k, sent):
        out = list(sent)
        for group in self.topology.groups(k):
            if len(group) == 1:
                continue
            copies = self.copies.get(group)
            if copies is None:  # a new pair: exact values
                copies = self.copies[group] = [sent[i].clone() for i in group]
            else:
                for a, i in enumerate(group):
                    copies[a] = copies[a] + self.quantize(sent[i] - copies[a])
            (a, i), (b, j) = enumerate(group)
            out[i] = sent[i] + 0.5 * (copies[b] - copies[a])
            out[j] = sent[j] + 0.5 * (copies[a] - copies[b])
        return out


def _check_simulated(starts, members, finals):
    expected = _live.simulate(starts, members, 1, mix=_Choco(len(members), _int8))
    for rank, (got, want) in enumerate(zip(finals, expected)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10, msg=f"rank {rank}")
    # the codec mattered: exact gossip from the same states ends elsewhere
    exact = _live.simulate(starts, members, 1)
    assert any(not torch.allclose(e, f, rtol=0, atol=1e-8) for e, f in zip(exact, finals))


@pytest.mark.multiprocess
def test_int8_survivors_train_on_as_the_dense_choco_simulation(tmp_path):
    results = run_world_fresh(
        _member, 4, str(tmp_path), "int8", True, None, timeout=90, killed=(VICTIM,)
    )
    survivors = [r for r in range(4) if r != VICTIM]
    assert results[VICTIM] is None
    for new_rank, old in enumerate(survivors):
        assert results[old]["view"] == (1, tuple(survivors), new_rank, (VICTIM,))
    starts = [results[r]["changed"] for r in survivors]
    assert max(s["count"] for s in starts) <= STEPS - 4, starts  # compressed rounds followed
    _check_simulated(starts, survivors, [results[r]["final"] for r in survivors])


@pytest.mark.multiprocess
def test_int8_newcomer_takes_the_source_state_and_trains_as_the_simulation(tmp_path):
    path = str(tmp_path)
    alone = start_alone(_newcomer, path, "int8")
    try:
        members = run_world_fresh(_member, 3, path, "int8", False, JOIN_AT, timeout=120)
    finally:
        newcomer = alone.result(timeout=120)
    joined, source = newcomer["joined"], members[0]["changed"]
    assert joined["count"] == source["count"] and joined["step"] == source["step"], joined
    for key in ("x", "m", "v"):
        assert torch.equal(joined[key], source[key]), key
    assert newcomer["view"] == (1, (0, 1, 2, 3), 3, ()), newcomer["view"]
    starts = [out["changed"] for out in members] + [joined]
    assert max(s["count"] for s in starts) <= STEPS - 4, starts
    finals = [out["final"] for out in members] + [newcomer["final"]]
    _check_simulated(starts, [0, 1, 2, 3], finals)


@pytest.mark.multiprocess
def test_sparse_codec_keeps_the_survivors_mean_and_contracts(tmp_path):
    path, codec = str(tmp_path), "top10%+int4"
    other = start_alone(_refused, path, "int8")
    try:
        results = run_world_fresh(
            _member, 4, path, codec, True, REFUSED_AT, True, timeout=120, killed=(VICTIM,)
        )
    finally:
        said = other.result(timeout=120)
    assert said is not None and "compression=" in said and "join again" in said, said
    survivors = [results[r] for r in range(4) if r != VICTIM]
    # took id 4 in, then dropped it and id 2 (in one agreement or two, as the kill falls)
    for new_rank, out in enumerate(survivors):
        assert out["view"][0] >= 2 and out["view"][1:3] == ((0, 1, 3), new_rank), out["view"]
    resume = max(out["changed"]["count"] for out in survivors)
    assert resume <= STEPS - 4, resume
    for t in range(resume, STEPS + GOSSIP_ONLY):
        before = sum(out["steps"][t][0] for out in survivors)
        after = sum(out["steps"][t][2] + LR * out["steps"][t][1] for out in survivors)
        if t >= STEPS:  # lr=0: the round alone
            after = sum(out["steps"][t][2] for out in survivors)
        torch.testing.assert_close(after, before, rtol=0, atol=1e-12, msg=f"step {t}")

    def spread(key):
        xs = torch.stack([out[key] for out in survivors])
        return float(torch.linalg.vector_norm(xs - xs.mean(0)))

    assert spread("final") < 0.5 * spread("trained"), (spread("trained"), spread("final"))

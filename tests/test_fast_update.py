"""The bucket-wide fast path of DecentralizedAdam(W): same results as torch.optim, also across
state_dict round trips, skipped gradients and changes of hyper-parameters."""

import pytest
import torch

import decent_optim as dopt

SMALL = [(6, 5), (5,), (3, 4, 2), (1,), (7,)] * 4  # many small tensors: one flat kernel call
LARGE = [(300, 250), (250,)]  # mean size above the flattening threshold: cached lists


def _pair(shapes, cls, torch_cls, **kw):
    gen = torch.Generator().manual_seed(0)
    mine = [torch.randn(s, generator=gen, dtype=torch.float64).requires_grad_() for s in shapes]
    theirs = [p.detach().clone().requires_grad_() for p in mine]
    return mine, theirs, cls(mine, **kw), torch_cls(theirs, **kw)


def _grads(mine, theirs, gen, skip=()):
    for k, (x, y) in enumerate(zip(mine, theirs)):
        if k in skip:
            x.grad = y.grad = None
        else:
            x.grad = torch.randn(x.shape, generator=gen, dtype=x.dtype)
            y.grad = x.grad.clone()


@pytest.mark.parametrize("shapes", [SMALL, LARGE], ids=["flat", "lists"])
@pytest.mark.parametrize(
    "cls, torch_cls, kw",
    [
        (dopt.DecentralizedAdamW, torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
        (dopt.DecentralizedAdam, torch.optim.Adam, dict(lr=0.01, weight_decay=0.1, amsgrad=True)),
        (dopt.DecentralizedAdam, torch.optim.Adam, dict(lr=0.02, maximize=True)),
    ],
)
def test_fast_path_matches_torch(shapes, cls, torch_cls, kw):
    mine, theirs, a, b = _pair(shapes, cls, torch_cls, **kw)
    gen = torch.Generator().manual_seed(1)
    for t in range(25):
        _grads(mine, theirs, gen)
        if t == 12:  # hyper-parameters are read at every step
            for g in (*a.param_groups, *b.param_groups):
                g["lr"] *= 0.5
        a.step()
        b.step()
    for x, y in zip(mine, theirs):
        # the same elementwise formula; only the vectorisation of the kernel may differ
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(a.state[x][key], b.state[y][key], rtol=0, atol=1e-12)


def test_step_counters_are_shared_after_the_first_step():
    mine, theirs, a, _ = _pair(SMALL, dopt.DecentralizedAdamW, torch.optim.AdamW, lr=0.01)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        _grads(mine, theirs, gen)
        a.step()
    steps = [a.state[p]["step"] for p in mine]
    assert len({s.untyped_storage().data_ptr() for s in steps}) == 1
    assert all(s.item() == 3 for s in steps)


def test_skipped_gradient_then_fast_again_matches_torch():
    mine, theirs, a, b = _pair(SMALL, dopt.DecentralizedAdamW, torch.optim.AdamW, lr=0.01)
    gen = torch.Generator().manual_seed(2)
    for t in range(15):
        _grads(mine, theirs, gen, skip=(3,) if t == 5 else ())
        a.step()
        b.step()
    for x, y in zip(mine, theirs):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12)
        assert a.state[x]["step"].item() == b.state[y]["step"].item()


def test_state_dict_round_trip_through_the_fast_path_is_exact():
    def run(resume_at=None):
        gen = torch.Generator().manual_seed(0)
        params = [torch.randn(s, generator=gen).requires_grad_() for s in SMALL]
        opt = dopt.DecentralizedAdamW(params, lr=0.01)
        grads = torch.Generator().manual_seed(3)
        for t in range(12):
            if t == resume_at:
                saved = opt.state_dict()
                opt = dopt.DecentralizedAdamW(params, lr=0.01)
                opt.load_state_dict(saved)
            for p in params:
                p.grad = torch.randn(p.shape, generator=grads)
            opt.step()
        return params, opt

    (x, a), (y, b) = run(), run(resume_at=6)
    for p, q in zip(x, y):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        assert a.state[p]["step"].item() == b.state[q]["step"].item() == 12


def _idle_buffers(rank, world_size):
    from decent_optim.gossip import Gossiper
    from decent_optim.topologies import get

    gossip = Gossiper(get("ring", world_size))
    buf = torch.full((6,), float(rank), dtype=torch.float64)
    before = gossip.idle_buffer(0, buf)  # nothing received yet: no buffer to lend
    handle = gossip.start([buf], 0)
    during = gossip.idle_buffer(0, buf)  # in flight: the receive buffer is busy
    handle.wait_and_mix_()
    after = gossip.idle_buffer(0, buf)
    wrong_shape = gossip.idle_buffer(0, torch.zeros(7, dtype=torch.float64))
    return before is None, during is None, after is not None, wrong_shape is None, buf.tolist()


@pytest.mark.multiprocess
def test_receive_buffers_are_lent_only_while_idle():
    for before, during, after, wrong_shape, mixed in __import__("_harness").run_world(
        _idle_buffers, 2
    ):
        assert (before, during, after, wrong_shape) == (True, True, True, True)
        assert mixed == [0.5] * 6


def _train_two_ranks(rank, world_size):
    # many small tensors: the flat path, with gradients in the borrowed receive buffer; rank i
    # minimises 1/2 ||x - b_i||^2, and every rank must keep matching the dense reference
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen, dtype=torch.float64).requires_grad_() for s in SMALL]
    opt = dopt.DecentralizedAdamW(params, lr=0.05, topology="ring")
    targets = [torch.full(p.shape, float(rank + 1), dtype=torch.float64) for p in params]
    for _ in range(8):
        for p, b in zip(params, targets):
            p.grad = p.detach() - b
        opt.step()
    opt.synchronize()
    return torch.cat([p.detach().reshape(-1) for p in params])


@pytest.mark.multiprocess
def test_flat_path_on_two_ranks_matches_a_dense_simulation():
    got = __import__("_harness").run_world(_train_two_ranks, 2)
    # dense reference: each rank's own AdamW on the mixed values (ring of 2: W = [[.5,.5],[.5,.5]])
    gen = torch.Generator().manual_seed(0)
    x0 = torch.cat([torch.randn(s, generator=gen, dtype=torch.float64).reshape(-1) for s in SMALL])
    xs = [x0.clone().requires_grad_(), x0.clone().requires_grad_()]
    opts = [torch.optim.AdamW([x], lr=0.05) for x in xs]
    for _ in range(8):
        for i, x in enumerate(xs):  # gradient at the unmixed local value
            x.grad = x.detach() - (i + 1)
        with torch.no_grad():  # combine (round 0 mixes identical values: no change) ...
            mean = (xs[0] + xs[1]) / 2
            for x in xs:
                x.copy_(mean)
        for o in opts:  # ... then adapt
            o.step()
    with torch.no_grad():
        final = (xs[0] + xs[1]) / 2
    for g in got:
        torch.testing.assert_close(g, final)

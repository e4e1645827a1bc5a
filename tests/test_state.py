"""opt.state kept in flat buffers: every write through opt.state is honoured or rejected.

The reference is torch.optim with the same writes (world size 1: the optimizers equal torch's).
"""

from __future__ import annotations

import gc
import pickle
import weakref

import pytest
import torch

import decent_optim as dopt
from decent_optim.flat import FlatParams
from decent_optim.optim.state import FlatState


def _pair(cls, torch_cls, torch_kw=None, **kw):
    gen = torch.Generator().manual_seed(0)
    mine = [
        torch.randn(s, generator=gen, dtype=torch.float64).requires_grad_()
        for s in [(3, 4), (5,), (2, 2)]
    ]
    theirs = [p.detach().clone().requires_grad_() for p in mine]
    return (
        mine,
        theirs,
        cls(mine, **kw),
        torch_cls(theirs, **(kw if torch_kw is None else torch_kw)),
    )


def _steps(mine, theirs, a, b, n, gen):
    for _ in range(n):
        for x, y in zip(mine, theirs):
            x.grad = torch.randn(x.shape, generator=gen, dtype=x.dtype)
            y.grad = x.grad.clone()
        a.step()
        b.step()


def _assert_same(mine, theirs):
    for x, y in zip(mine, theirs):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "cls, torch_cls, kw, key",
    [
        (dopt.DecentralizedAdamW, torch.optim.AdamW, dict(lr=0.01), "exp_avg"),
        (dopt.DecentralizedAdam, torch.optim.Adam, dict(lr=0.01, amsgrad=True), "max_exp_avg_sq"),
        (dopt.DSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9), "momentum_buffer"),
        (dopt.AccumAdam, torch.optim.Adam, dict(lr=0.01), "exp_avg_sq"),
    ],
)
def test_a_state_tensor_replaced_by_hand_is_used_by_the_next_step(cls, torch_cls, kw, key):
    extra = dict(accum_iter=1) if cls is dopt.AccumAdam else {}  # accum_iter=1: exactly Adam
    mine, theirs, a, b = _pair(cls, torch_cls, torch_kw=kw, **kw, **extra)
    gen = torch.Generator().manual_seed(1)
    _steps(mine, theirs, a, b, 3, gen)
    new = torch.full_like(mine[1], 0.25)
    a.state[mine[1]][key] = new.clone()
    b.state[theirs[1]][key] = new.clone()
    _steps(mine, theirs, a, b, 4, gen)
    _assert_same(mine, theirs)
    # and the state lives in the flat buffers again: one storage for the bucket's tensors
    assert (
        a.state[mine[1]][key].untyped_storage().data_ptr()
        == a.state[mine[0]][key].untyped_storage().data_ptr()
    )


def test_a_whole_state_entry_replaced_by_hand_is_used_too():
    mine, theirs, a, b = _pair(dopt.DecentralizedAdamW, torch.optim.AdamW, lr=0.01)
    gen = torch.Generator().manual_seed(2)
    _steps(mine, theirs, a, b, 2, gen)
    ones = torch.ones(5, dtype=torch.float64)
    entry = {"step": torch.tensor(10.0), "exp_avg": ones, "exp_avg_sq": 2 * ones}
    a.state[mine[1]] = {k: v.clone() for k, v in entry.items()}
    b.state[theirs[1]] = {k: v.clone() for k, v in entry.items()}
    _steps(mine, theirs, a, b, 3, gen)
    _assert_same(mine, theirs)
    assert float(a.state[mine[1]]["step"]) == 13.0


def test_a_step_count_set_as_a_plain_number_counts():
    mine, theirs, a, b = _pair(dopt.DecentralizedAdam, torch.optim.Adam, lr=0.01)
    gen = torch.Generator().manual_seed(3)
    _steps(mine, theirs, a, b, 2, gen)
    a.state[mine[0]]["step"] = 7  # an int, as older torch versions kept it
    b.state[theirs[0]]["step"] = torch.tensor(7.0)
    _steps(mine, theirs, a, b, 2, gen)
    _assert_same(mine, theirs)


@pytest.mark.parametrize(
    "key, value, match",
    [
        (
            "exp_avg",
            torch.zeros(3),
            r"'exp_avg' of a parameter of shape \(3, 4\) must be a tensor of that shape, got \(3,\)",
        ),
        ("exp_avg", 1.0, r"must be a tensor of that shape, got float"),
        ("step", -2, r"'step' .* must count steps \(a whole number >= 0"),
        ("step", 2.5, r"must count steps"),
        ("step", torch.tensor(float("nan")), r"must count steps"),
    ],
    ids=["wrong-shape", "not-a-tensor", "negative-step", "fractional-step", "nan-step"],
)
def test_state_that_cannot_be_that_state_is_rejected_naming_it(key, value, match):
    mine, theirs, a, b = _pair(dopt.DecentralizedAdam, torch.optim.Adam, lr=0.01)
    _steps(mine, theirs, a, b, 1, torch.Generator().manual_seed(4))
    before = mine[0].detach().clone()
    a.state[mine[0]][key] = value
    mine[0].grad = torch.ones_like(mine[0])
    with pytest.raises(ValueError, match=match):
        a.step()
    assert torch.equal(mine[0].detach(), before), "a rejected state must not move the parameter"


def test_optimizer_state_pickles_as_plain_dicts():
    mine, theirs, a, b = _pair(dopt.DSGD, torch.optim.SGD, lr=0.05, momentum=0.9)
    _steps(mine, theirs, a, b, 2, torch.Generator().manual_seed(5))
    packed = pickle.loads(pickle.dumps(a.state_dict()))
    assert type(packed["state"]) is dict and all(type(v) is dict for v in packed["state"].values())
    assert type(pickle.loads(pickle.dumps(a.state))).__name__ == "defaultdict"


def _flat_state_of_one_bucket():
    p = torch.nn.Parameter(torch.ones(5))
    p.grad = torch.full((5,), 2.0)
    flat = FlatParams([[p]], bucket_cap_mb=1)
    return flat.buckets[0], FlatState(flat.buckets, dopt.DecentralizedAdamW.rule), p.grad


def test_own_gradient_buffer_is_freed_once_the_gossip_lends_one():
    # every-step gossip has no receive buffer to lend at the first step only: the buffer made
    # for that step must not stay allocated (it was a parameter-sized copy kept for good)
    bucket, state, grad = _flat_state_of_one_bucket()
    lent = torch.empty_like(bucket.data)
    first = state._flat_grads(0, bucket, [grad], lambda i, like: None)
    assert torch.equal(first, grad)
    own = weakref.ref(first)
    del first
    for _ in range(3):
        assert state._flat_grads(0, bucket, [grad], lambda i, like: lent) is lent
        assert torch.equal(lent, grad)
    gc.collect()
    assert own() is None


def test_own_gradient_buffer_is_kept_where_the_gossip_seldom_lends():
    # local steps: a round travels through most steps; re-making the buffer every period would
    # allocate a parameter-sized tensor every few steps
    bucket, state, grad = _flat_state_of_one_bucket()
    lent = torch.empty_like(bucket.data)
    pattern = [None, lent, None, lent, None, None, lent, None]
    bufs = [state._flat_grads(0, bucket, [grad], lambda i, like, b=b: b) for b in pattern]
    assert all(torch.equal(b, grad) for b in bufs)
    own = {id(b) for b, lend in zip(bufs, pattern) if lend is None}
    assert len(own) == 2  # the first step's, freed; then one made again and kept

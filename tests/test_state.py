"""opt.state kept in flat buffers: every write through opt.state is honoured or rejected.

The reference is torch.optim with the same writes (world size 1: the optimizers equal torch's).
"""

from __future__ import annotations

import pickle

import pytest
import torch

import decent_optim as dopt


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

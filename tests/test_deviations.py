"""Where a decentralized optimizer cannot do what torch.optim does, it says so on every rank.

Each case was a silent deviation (issue "Ranks that disagree", items 7-9): in-place writes racing
with the round in flight, a NaN at tiny learning rates, a step undone by ``averaged()``, a
parameter appended by hand, a parameter shared by two optimizers, per-rank weights kept after an
optimizer-only load. Each now behaves as torch.optim does or raises a clear error on every rank.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from _harness import run_world
from test_agreement import _assert_same_error, _attempt
from torch import nn

import decent_optim as dopt
from decent_optim.rules.base import FOLD_MIN_LR, can_fold


def _train(model, opt, rank, steps, after_step=None):
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, model.in_features, generator=gen)).square().mean().backward()
        opt.step()
        if after_step is not None:
            after_step()


def _vector(model):
    return nn.utils.parameters_to_vector(model.parameters()).detach().clone()


# -- 7: in-place writes between step() and the next step() ------------------------------------


def _clip(rank, world_size, synchronize_first):
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    opt = dopt.DSGD(model.parameters(), lr=0.5, topology="ring")

    def clip():  # WGAN-style weight clipping after every step
        if synchronize_first:
            opt.synchronize()
        with torch.no_grad():
            for p in model.parameters():
                p.clamp_(-0.2, 0.2)

    outcome = _attempt(_train, model, opt, rank, 5, clip)
    opt.synchronize() if outcome[0] == "ok" else None
    return outcome, _vector(model)


@pytest.mark.multiprocess
def test_writing_parameters_while_their_round_is_in_flight_raises_on_every_rank():
    got = run_world(_clip, 2, False)
    _assert_same_error(
        [outcome for outcome, _ in got],
        "were written in place after step() while gossip round 1 was still sending them",
        "Call opt.synchronize() before writing parameters",
        kind="RuntimeError",
    )


@pytest.mark.multiprocess
def test_writing_parameters_after_synchronize_is_deterministic_and_ranks_agree():
    first, second = run_world(_clip, 2, True), run_world(_clip, 2, True)
    for (outcome, values), (_, again) in zip(first, second):
        assert outcome[0] == "ok", outcome
        assert torch.equal(values, again), "the same run must give the same values"
    assert torch.equal(first[0][1], first[1][1]), "a pair's final mix is the same on both ranks"
    assert first[0][1].abs().max() <= 0.2


# -- 8: no NaN at learning rates where torch.optim has none ------------------------------------


def _tiny_lr(rank, world_size, name, weight_decay):
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    opt = getattr(dopt, name)(model.parameters(), lr=1.0, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(140):  # 0.5**126 * 1.0 is below float32's smallest normal number
        opt.zero_grad()
        model(torch.randn(4, 3, generator=gen)).square().mean().backward()
        opt.step()
        sched.step()
    opt.synchronize()
    return _vector(model), opt.param_groups[0]["lr"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "name, weight_decay", [("DSGD", 0.0), ("DSGD", 0.1), ("DecentralizedAdamW", 0.1)]
)
def test_tiny_learning_rates_give_no_nan(name, weight_decay):
    for values, lr in run_world(_tiny_lr, 2, name, weight_decay):
        assert lr < FOLD_MIN_LR
        assert torch.isfinite(values).all(), values


def test_the_mix_factor_is_folded_only_where_the_folded_decay_is_finite():
    assert can_fold(1e-3) and can_fold(FOLD_MIN_LR)
    assert not can_fold(FOLD_MIN_LR / 2) and not can_fold(1e-39) and not can_fold(0.0)
    assert not can_fold(torch.tensor(0.1)) and not can_fold(True)


# -- 9: API deviations -------------------------------------------------------------------------


def _inside_averaged(rank, world_size, what):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = dopt.DSGD(model.parameters(), lr=0.1, topology="ring")
    _train(model, opt, rank, 2)
    before = _vector(model)
    with opt.averaged(model):
        outcome = (
            _attempt(getattr(opt, what))
            if what != "load_state_dict"
            else _attempt(opt.load_state_dict, opt.state_dict())
        )
    return outcome, torch.equal(_vector(model), before)


@pytest.mark.multiprocess
@pytest.mark.parametrize("what", ["step", "synchronize", "load_state_dict"])
def test_what_averaged_would_undo_raises_inside_it(what):
    got = run_world(_inside_averaged, 2, what)
    _assert_same_error(
        [outcome for outcome, _ in got],
        f"{what}() inside opt.averaged(): the block puts every rank's own parameters back",
        kind="RuntimeError",
    )
    assert all(unchanged for _, unchanged in got)


def _appended(rank, world_size, how):
    torch.manual_seed(0)
    model, extra = nn.Linear(3, 2), nn.Parameter(torch.ones(2))
    opt = dopt.DSGD(model.parameters(), lr=0.1, topology="ring")
    _train(model, opt, rank, 1)
    if how == "append":
        opt.param_groups[0]["params"].append(extra)
    elif how == "replace":
        opt.param_groups[0]["params"][1] = extra
    else:
        opt.param_groups.append({**opt.param_groups[0], "params": [extra]})
    extra.grad = torch.ones(2)
    return _attempt(_train, model, opt, rank, 1)


@pytest.mark.multiprocess
@pytest.mark.parametrize("how, group", [("append", 0), ("replace", 0), ("group", 1)])
def test_a_parameter_added_to_param_groups_by_hand_raises_at_step(how, group):
    _assert_same_error(
        run_world(_appended, 2, how),
        f"the parameters of DSGD.param_groups[{group}] changed after it was built",
        "Pass every parameter to the constructor",
        kind="RuntimeError",
    )


def _shared(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    whole = dopt.DSGD(model.named_parameters(), lr=0.1, topology="ring")
    head = dopt.DecentralizedAdam(model[1].parameters(), lr=0.1, topology="ring")
    model(torch.randn(2, 3)).sum().backward()
    first = _attempt(whole.step)
    second = _attempt(head.step)
    head.synchronize()
    return first, second


@pytest.mark.multiprocess
def test_a_parameter_given_to_two_optimizers_is_refused_by_the_first():
    got = run_world(_shared, 2)
    _assert_same_error(
        [first for first, _ in got],
        "this DSGD cannot step any more: its parameter '1.weight' was given to another "
        "DecentralizedAdam built after it",
        kind="RuntimeError",
    )
    assert all(second[0] == "ok" for _, second in got)


def _tied(rank, world_size, how):
    torch.manual_seed(0)
    encoder = nn.Linear(3, 4, bias=False)
    if how == "two-parameters":  # tied as two Parameter objects over one tensor
        decoder_weight = nn.Parameter(encoder.weight.data)
        params = [encoder.weight, decoder_weight]
    else:  # the same parameter twice in one group
        params = [encoder.weight, encoder.weight]
    return _attempt(dopt.DSGD, params, lr=0.1)


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["two-parameters", "twice"])
def test_parameters_that_share_memory_are_refused_on_every_rank(how):
    _assert_same_error(
        run_world(_tied, 2, how),
        "parameters 0 (shape (4, 3)) and 1 (shape (4, 3)) share memory",
        "tie weights by sharing one Parameter",
        kind="ValueError",
    )


def _optimizer_only_load(rank, world_size, ckpt_dir, unseeded):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = dopt.DSGD(model.parameters(), lr=0.1, momentum=0.9, topology="ring")
    _train(model, opt, rank, 3)
    path = os.path.join(ckpt_dir, f"rank{rank}.pt")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    ckpt = torch.load(path, weights_only=True)
    torch.manual_seed(100 + rank if unseeded else 0)  # a fresh model, unseeded: per-rank weights
    model = nn.Linear(3, 2)
    if not unseeded:
        model.load_state_dict(ckpt["model"])  # the model-first resume: keeps its weights
    own = _vector(model)
    opt = dopt.DSGD(model.parameters(), lr=0.1, momentum=0.9, topology="ring")
    opt.load_state_dict(ckpt["opt"])
    return own, _vector(model)


@pytest.mark.multiprocess
def test_an_optimizer_only_load_starts_every_rank_from_rank_zero_like_ddp(tmp_path):
    got = run_world(_optimizer_only_load, 2, str(tmp_path), True)
    assert not torch.equal(got[0][0], got[1][0]), "the unseeded models should differ"
    for _, loaded in got:
        assert torch.equal(loaded, got[0][0]), "every rank starts from rank 0's weights"
    resumed = run_world(_optimizer_only_load, 2, str(tmp_path), False)
    for own, loaded in resumed:
        assert torch.equal(loaded, own), "weights saved with the checkpoint are kept"
    assert not math.isclose(float(resumed[0][1].sum()), float(resumed[1][1].sum()))

"""A checkpoint whose local steps do not fit the optimizer on one rank only (review of issue 39).

``load_state_dict`` is a collective: the ranks compare their files in one agreement. The check of
the local steps' entry (decent_optim.optim.local_checkpoint.check) used to run before it, so the
rank at fault raised at once and left while the others waited for it in the agreement until the
timeout (a GossipError much later, naming no cause). The fault is injected into one rank's state
dict; every rank must raise the same ValueError at once, naming that rank and what to do, and
stay in step (a good load afterwards works on every rank).
"""

from __future__ import annotations

import pytest
import torch
from _harness import run_world_fresh
from _uneven import train
from test_optim_multiprocess import _model

import decent_optim as dopt

pytestmark = pytest.mark.multiprocess

TIMEOUT = 5  # s: the old code's wait for the rank at fault; a short one, so that it fails fast

FAULTS = {  # what rank 1's entry says instead of local_steps=2, outer=None, step-locked
    "local_steps": (lambda e: {**e, "local_steps": 3}, "saved with local_steps=3, outer=None"),
    "outer": (lambda e: {**e, "outer": "LocalOuterSGD(every=4)"}, "outer=LocalOuterSGD(every=4)"),
    "uneven": (lambda e: {**e, "uneven": {}}, "uneven=True; this optimizer has local_steps=2"),
    "damaged": (lambda e: "garbage", "['local_steps'] is not what state_dict() saved"),
}


def _build():
    model = _model()
    opt = dopt.DecentralizedAdamW(
        model.parameters(), lr=0.01, topology="ring", local_steps=2, timeout=TIMEOUT
    )
    return model, opt


def _load_with_a_fault(rank, n, fault):
    model, opt = _build()
    train(model, opt, rank, 0, 5)  # mid-period, a round in flight
    saved = opt.state_dict()
    opt.synchronize()
    if rank == 1:
        bad = {**saved, "decent_optim": dict(saved["decent_optim"])}
        bad["decent_optim"]["local_steps"] = FAULTS[fault][0](saved["decent_optim"]["local_steps"])
    else:
        bad = saved
    model, opt = _build()
    try:
        opt.load_state_dict(bad)
        outcome = ("loaded", "")
    except Exception as err:
        outcome = (type(err).__name__, str(err))
    opt.load_state_dict(saved)  # the ranks are still in step: the good files load everywhere
    train(model, opt, rank, 5, 7)
    return outcome, bool(torch.isfinite(torch.cat([p.flatten() for p in model.parameters()])).all())


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_bad_local_steps_entry_on_one_rank_is_the_same_error_on_every_rank(fault):
    runs = run_world_fresh(_load_with_a_fault, 2, fault)
    (outcome0, finite0), (outcome1, finite1) = runs
    for kind, message in (outcome0, outcome1):
        assert kind == "ValueError", (kind, message)
        assert "DecentralizedAdamW.load_state_dict failed on rank 1" in message, message
        assert FAULTS[fault][1] in message, message
    assert outcome0 == outcome1
    assert finite0 and finite1

"""Parameters replaced while a gossip round is in flight, and weights tied after construction.

``p.data = t`` between steps without ``synchronize()`` used to be mixed with the neighbours'
values of the round in flight at the next step (100 became about 50 on two ranks); the round is
now settled first, so the next step updates exactly ``t``, as torch.optim would. Writing in place
(``model.load_state_dict``) while the round is in flight raises, as before. Weights tied with
``b.data = a.data`` after the optimizer was built used to be untied silently; that is an error.
"""

from __future__ import annotations

import pytest
import torch
from _harness import run_world
from torch import nn

import decent_optim as dopt


def _replace(rank, world_size, how):
    model = nn.Linear(3, 2)
    opt = dopt.DSGD(model.parameters(), lr=0.0)  # pure averaging: the values move only by mixing
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        opt.step()  # leaves a round in flight
    if how == "data":
        for p in model.parameters():
            p.data = torch.full_like(p, 100.0)
    else:
        sd = {k: torch.full_like(v, 100.0) for k, v in model.state_dict().items()}
        model.load_state_dict(sd)
    try:
        opt.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        after_step = torch.cat([p.detach().flatten() for p in model.parameters()])
        opt.synchronize()
    except RuntimeError as err:
        opt.synchronize()  # the ranks stay in step for the next task
        return str(err)
    return after_step, torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.multiprocess
def test_new_data_while_a_round_is_in_flight_is_what_the_next_step_updates():
    for after_step, settled in run_world(_replace, 2, "data"):
        torch.testing.assert_close(after_step, torch.full_like(after_step, 100.0))
        torch.testing.assert_close(settled, torch.full_like(settled, 100.0))


@pytest.mark.multiprocess
def test_model_load_state_dict_while_a_round_is_in_flight_raises_clearly():
    for message in run_world(_replace, 2, "load_state_dict"):
        assert "written in place after step()" in message, message
        assert "Call opt.synchronize() before writing" in message, message


def test_weights_tied_after_construction_are_refused():
    a, b = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))
    opt = dopt.DSGD([a, b], lr=0.1)
    b.data = a.data  # tied by hand: torch.optim would update the shared memory twice
    a.grad, b.grad = torch.ones(4), torch.ones(4)
    with pytest.raises(ValueError, match=r"after DSGD was built, parameters 0 .* share memory"):
        opt.step()

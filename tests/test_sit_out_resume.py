"""Checkpoints of topologies in which a rank sits a round out (``ring`` on 3 ranks).

A rank alone in its group has nothing to exchange, so its round has no handle; its file must
still say, as its neighbours' do, that a round is in flight, or the load's agreement refuses the
checkpoint on every rank ("the ranks disagree on the round ... no round in flight"). The resumed
run is compared bit for bit with the uninterrupted one.
"""

from __future__ import annotations

import pytest
import torch
from _harness import run_world
from _uneven import resume_in_memory
from test_optim_multiprocess import OPTIMIZERS, _model, _param_groups


def _straight_and_resumed(rank, n, local_steps, save_at, steps):
    cls, kwargs, *_ = OPTIMIZERS["DecentralizedAdamW"]

    def make():
        model = _model()
        return model, cls(_param_groups(model), **kwargs, topology="ring", local_steps=local_steps)

    def sits_out(opt):
        # this rank's round (the one just launched) has nothing to exchange
        topo, rank, round = opt.topology, opt.rank, opt.round
        return not topo.in_peers(rank, round) and not topo.out_peers(rank, round)

    run = resume_in_memory(rank, make, save_at, steps, note=sits_out)
    return run.noted, run.straight, run.resumed


@pytest.mark.multiprocess
@pytest.mark.parametrize("local_steps, save_at", [(1, 7), (1, 6), (2, 6), (2, 7)])
def test_a_checkpoint_where_a_rank_sits_the_round_out_resumes_bit_for_bit(local_steps, save_at):
    runs = run_world(_straight_and_resumed, 3, local_steps, save_at, 12)
    if local_steps == 1:  # every step launches a round; in each, one of the three sits out
        assert any(sits_out for sits_out, *_ in runs), "no rank sat out: the test is vacuous"
    for _, straight, resumed in runs:
        assert torch.equal(straight, resumed)

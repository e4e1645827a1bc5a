"""The mistakes of real training scripts: each reproduced, and the warning or error it must get.

* DDP kept around the model after swapping in our optimizer (or a hook that all-reduces the
  gradients): the job pays for the all-reduce *and* the gossip, and the gossip mixes identical
  copies. Warned once, with the fix.
* Work that only rank 0 does (evaluation, saving) inside the loop: its peers time out, and the
  error must say that a busy peer looks like a dead one, and what to do.
* The plan CLI run without torchrun, and its help.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from _harness import run_world, run_world_fresh, wait_for_the_other_ranks
from torch import nn

import decent_optim as dopt
from decent_optim import plan
from decent_optim.gossip import GossipError

# -- DDP kept, optimizer swapped -------------------------------------------------------------------


def _train_wrapped(rank, world_size, how):
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    net: nn.Module = model
    if how in ("ddp", "ddp+allreduce_hook", "ddp+noop_hook"):
        net = DDP(model)
        if how != "ddp":
            hook = allreduce_hook if how == "ddp+allreduce_hook" else noop_hook
            net.register_comm_hook(None, hook)
    elif how == "grad_hook":  # a hand-written all-reduce of every gradient

        def average(p):
            dist.all_reduce(p.grad)
            p.grad /= world_size

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(average)
    opt = dopt.DecentralizedAdamW(model.parameters(), lr=1e-2, topology="ring")
    data_rank = 0 if how == "same_data" else rank
    gen = torch.Generator().manual_seed(100 + data_rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            x = torch.randn(16, 6, generator=gen)
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
    return [str(w.message) for w in caught if "identical on every rank" in str(w.message)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["ddp", "ddp+allreduce_hook", "grad_hook", "same_data"])
def test_gradients_averaged_before_step_are_warned_once_with_the_fix(how):
    for messages in run_world(_train_wrapped, 2, how):
        assert len(messages) == 1, messages  # three steps, one warning
        text = messages[0]
        assert text.startswith("DecentralizedAdamW: the gradients are identical on every rank")
        assert "DistributedDataParallel" in text and "`model = DDP(model)` -> `model`" in text
        assert "DecentralizedStrategy" in text and "DistributedSampler" in text


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["plain", "ddp+noop_hook"])
def test_own_gradients_are_not_warned(how):
    # DDP with torch's noop_hook averages nothing: each rank steps on its own gradient, which
    # is what decentralized training needs (the wrapper only costs its bucket copies)
    assert run_world(_train_wrapped, 2, how) == [[], []]


def test_one_rank_has_nobody_to_compare_with():
    model = nn.Linear(3, 1)
    opt = dopt.DSGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.ones(2, 3)).sum().backward()
        opt.step()


# -- work that only rank 0 does ------------------------------------------------------------------


def _rank0_evaluates_alone(rank, world_size):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = dopt.DecentralizedAdamW(model.parameters(), lr=1e-2, topology="ring", timeout=2.0)
    gen = torch.Generator().manual_seed(rank)
    try:
        for t in range(6):
            opt.zero_grad()
            model(torch.randn(8, 4, generator=gen)).square().mean().backward()
            opt.step()
            if rank == 0 and t == 2:
                # "evaluation" or a checkpoint written by rank 0 only, until rank 1 gave up
                wait_for_the_other_ranks()
        opt.synchronize()
    except GossipError as err:
        return str(err)
    except RuntimeError as err:  # rank 0, back from its work, finds its peer gone
        return f"rank 0: {err}"
    return "no error"


@pytest.mark.multiprocess
def test_a_peer_busy_in_rank_only_work_is_not_blamed_as_dead_only():
    messages = run_world_fresh(_rank0_evaluates_alone, 2, timeout=90)
    text = messages[1]  # rank 1 waited for rank 0: round 3 was posted before the sleep, 4 not
    assert text.startswith("[rank 1] gossip round 4: peer(s) [0] did not take part in it within")
    assert "(timeout 2 s)" in text
    assert "busy in work that only some ranks do" in text
    assert "evaluation or checkpointing" in text
    assert "opt.averaged(model)" in text and "opt.synchronize() and a barrier" in text
    assert "longer timeout=" in text and "docs/training_loops" in text


# -- the plan CLI --------------------------------------------------------------------------------


def test_plan_help_says_it_runs_under_torchrun_and_documents_every_flag(capsys):
    with pytest.raises(SystemExit):
        plan.main(["--help"])
    text = capsys.readouterr().out
    assert "must run under torchrun" in text
    assert "torchrun --standalone --nproc-per-node" in text
    assert "one-peer-exp needs a power-of-two number of workers" in text
    undocumented = [a.dest for a in plan._parser()._actions if not a.help]
    assert not undocumented, undocumented


def test_plan_without_torchrun_shows_the_standalone_command(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit, match="must run in every process") as info:
        plan.main(["--params", "100"])
    assert "torchrun --standalone --nproc-per-node" in str(info.value)


def test_plan_says_why_a_topology_was_left_out():
    measured = {
        "world_size": 3, "local_world_size": 1, "backend": "gloo", "params": 10, "bytes": 40,
        "compute_mean_s": 0.1, "compute_std_s": 0.0, "backward_fraction": 0.5, "update_s": 0.0,
        "allreduce_s": 0.3, "gossip": {"ring": {"round_s": [0.05] * 3, "degrees": [2] * 3}},
        "skipped": {"one-peer-exp": "one-peer-exp needs a power-of-two world size (1, 2, 4, 8, ...), got 3"},
    }  # fmt: skip
    table = plan.format_table(measured, plan.predict(measured, overlap=1.0))
    assert "not measured: one-peer-exp: one-peer-exp needs a power-of-two world size" in table

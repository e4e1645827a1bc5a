"""``decent_optim.checkpoint`` across ranks (issue 33, items 2, 6 and 7b): sharded models are
refused at once on every rank, naming the torch.distributed.checkpoint route; a rank that never
calls ``load`` is named by the others within the optimizer's ``timeout=``; a damaged rank file
is reported on every rank, naming the file and the step to load instead.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from _harness import run_world, run_world_fresh

import decent_optim as dopt
from decent_optim import checkpoint
from decent_optim.checkpoint import directory

pytestmark = pytest.mark.multiprocess


def _outcome(call) -> tuple[str, str] | None:
    try:
        call()
    except Exception as err:
        return type(err).__name__, str(err)
    return None


# -- item 2: sharded (FSDP2) parameters --------------------------------------------------------


def _sharded(rank, world, root):
    from test_sharded import _build, _steps

    model, opt, _ = _build(2, 2)
    _steps(model, opt, rank // 2, 0, 1)
    loaded = _outcome(lambda: checkpoint.load(root, model, opt))
    saved = _outcome(lambda: checkpoint.save(root, model, opt, step=1, timeout=5))
    saved_in_background = _outcome(
        lambda: checkpoint.save(root, model, opt, step=1, timeout=5, background=True)
    )
    checkpoint.wait(root)
    return loaded, saved, saved_in_background


def test_sharded_parameters_are_refused_on_every_rank_naming_dcp(tmp_path):
    root = tmp_path / "ckpt"
    for rank, outcomes in enumerate(run_world(_sharded, 4, str(root))):
        for call, outcome in zip(("load", "save", "save"), outcomes):
            assert outcome is not None, f"rank {rank}: {call} was not refused"
            kind, message = outcome
            assert kind == "TypeError", outcome
            for part in (
                f"decent_optim.checkpoint.{call} does not support sharded parameters",
                "torch.distributed.checkpoint",
                'process_group=mesh["shard"].get_group()',
                "docs: large_models",
                "DecentralizedModelParallelStrategy",
            ):
                assert part in message, (rank, part, message)
    assert not root.exists() or list(root.rglob("*")) == []


# -- item 6: a rank that never calls load --------------------------------------------------------


def _one_skips_load(rank, world, root, timeout):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = dopt.DecentralizedAdamW(model.parameters(), lr=0.1, timeout=timeout)
    if rank == world - 1:  # the fault: it goes on without loading
        return None
    start = time.monotonic()
    outcome = _outcome(lambda: checkpoint.load(root, model, opt))
    return outcome, time.monotonic() - start


def test_a_rank_that_never_calls_load_is_named_within_the_timeout(tmp_path):
    timeout = 3.0
    results = run_world_fresh(_one_skips_load, 3, str(tmp_path), timeout, timeout=120)
    assert results[2] is None
    for rank, (outcome, seconds) in enumerate(results[:2]):
        assert outcome is not None, f"rank {rank} loaded without rank 2"
        kind, message = outcome
        assert kind == "GossipError", outcome
        assert "decent_optim.checkpoint.load" in message and "rank(s) [2]" in message, message
        assert "never reached it (timeout 3 s)" in message, message
        assert "Every rank must call decent_optim.checkpoint.load()" in message, message
        # the process group's own timeout is 30 s: this is the optimizer's
        assert seconds < timeout + 10, (rank, seconds)


# -- item 7b: a damaged file on one rank -----------------------------------------------------------


def _save_two_steps(rank, world, root):
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    opt = dopt.DecentralizedAdamW(model.parameters(), lr=0.1, timeout=30)
    for step in (1, 2):
        opt.zero_grad()
        model(torch.randn(2, 32)).square().mean().backward()
        opt.step()
        checkpoint.save(root, model, opt, step=step)
        checkpoint.wait(root)
        if step == 1:
            first = {k: v.clone() for k, v in model.state_dict().items()}
    return first


def _load_damaged(rank, world, root):
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    opt = dopt.DecentralizedAdamW(model.parameters(), lr=0.1, timeout=30)
    damaged = _outcome(lambda: checkpoint.load(root, model, opt))
    resumed = checkpoint.load(root, model, opt, step=1)
    return damaged, resumed.step, model.state_dict()


def test_a_damaged_rank_file_is_reported_on_every_rank(tmp_path):
    first = run_world(_save_two_steps, 2, str(tmp_path))
    folder = tmp_path / "step-00000002"
    manifest = directory.read_manifest(folder)
    assert manifest is not None
    path = folder / manifest.files[1]
    path.write_bytes(path.read_bytes()[:4000])  # cut short, and a manifest made to agree
    manifest.sizes[1] = os.path.getsize(path)
    directory.commit_manifest(folder, manifest)
    for rank, (damaged, step, state) in enumerate(run_world(_load_damaged, 2, str(tmp_path))):
        assert damaged is not None and damaged[0] == "ValueError", (rank, damaged)
        for part in (str(path.resolve()), "step 2", "cannot be read", "step=1"):
            assert part in damaged[1], (rank, part, damaged[1])
        assert step == 1
        for key, value in state.items():
            assert torch.equal(value, first[rank][key]), (rank, key)


# -- issue 39, item 2: a save inside opt.averaged() ------------------------------------------------


def _save_inside_averaged(rank, world, root):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = dopt.DecentralizedAdamW(model.parameters(), lr=0.1, timeout=30)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):  # the ranks' copies differ after their own updates: the average is neither
        opt.zero_grad()
        model(torch.randn(2, 8, generator=gen)).sum().backward()
        opt.step()
    own = {k: v.clone() for k, v in model.state_dict().items()}
    with opt.averaged(model):
        inside = _outcome(lambda: checkpoint.save(root, model, opt, step=1))
        checkpoint.wait(root)
    dist.barrier()  # every rank's refused save is over before any looks
    written = os.path.exists(root) and os.listdir(root)
    dist.barrier()  # ... and has looked before any saves
    checkpoint.save(root, model, opt, step=1)  # after the block, as the refusal says
    checkpoint.wait(root)
    fresh = torch.nn.Linear(8, 8)
    checkpoint.load(root, fresh, dopt.DecentralizedAdamW(fresh.parameters(), lr=0.1, timeout=30))
    return inside, written, own, fresh.state_dict()


def test_a_save_inside_averaged_is_refused_on_every_rank(tmp_path):
    root = str(tmp_path / "ckpt")
    results = run_world(_save_inside_averaged, 2, root)
    assert not torch.equal(results[0][2]["weight"], results[1][2]["weight"])
    for rank, (inside, written, own, loaded) in enumerate(results):
        assert inside is not None and inside[0] == "RuntimeError", (rank, inside)
        assert "checkpoint.save inside opt.averaged()" in inside[1], (rank, inside)
        assert not written, (rank, written)
        for key, value in loaded.items():  # the rank's own copy, not the average
            assert torch.equal(value, own[key]), (rank, key)

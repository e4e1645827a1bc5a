"""Ranks that disagree: every mismatch is one clear error on every rank, within seconds.

Each case is a mistake of real multi-process code (issue "Ranks that disagree"): the ranks build
or load something that does not match. Every rank must raise the same error, naming what differs
and the ranks on each side, within a few seconds -- never a gossip timeout, never a silent mix.
The helpers return ``(outcome, seconds)`` per rank, so the parent checks every rank.
"""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
from _harness import run_world
from torch import nn

import decent_optim as dopt
from decent_optim.optim.agreement import Account, explain
from decent_optim.optim.param_owner import ParamOwner

#: an error must come well before the harness's 30 s process-group timeout
PROMPT_S = 10.0


def _together():
    """Import what the first optimizer of a process imports, then wait for every rank."""
    # torch.optim imports torch._dynamo at the first optimizer a process builds: seconds on a
    # busy machine, and on one rank possibly longer than the process group's 30 s timeout, so
    # the ranks meet afterwards, at a barrier with a deadline of its own
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=300))


def _attempt(fn, *args, **kwargs):
    """``(outcome, seconds)``: ``"ok"`` or ``"<Type>: <message>"``."""
    _together()  # not part of what is timed
    start = time.monotonic()
    try:
        fn(*args, **kwargs)
        outcome = "ok"
    except Exception as err:
        outcome = f"{type(err).__name__}: {err}"
    return outcome, time.monotonic() - start


def _assert_same_error(got, *fragments, kind=None):
    """Every rank raised the same error, containing every fragment, promptly."""
    outcomes = [outcome for outcome, _ in got]
    assert len(set(outcomes)) == 1, outcomes
    for fragment in fragments:
        assert fragment in outcomes[0], outcomes[0]
    if kind is not None:
        assert outcomes[0].startswith(f"{kind}: "), outcomes[0]
    assert all(seconds < PROMPT_S for _, seconds in got), got


def _build(rank, world_size, case):
    """Build an optimizer whose arguments differ across the ranks as ``case`` says."""
    torch.manual_seed(0)
    kwargs = {}
    if case == "order-named":  # param groups from a Python set: another order per process
        model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
        named = list(model.named_parameters())
        params = named if rank == 0 else named[2:] + named[:2]
    elif case == "order-shapes":
        a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(4, 2))
        params = [a, b] if rank == 0 else [b, a]
    elif case == "strides":
        conv = nn.Conv2d(3, 4, 3)
        if rank == 1:
            conv = conv.to(memory_format=torch.channels_last)
        params = list(conv.named_parameters())
    elif case == "requires-grad":
        model = nn.Linear(3, 3)
        model.bias.requires_grad_(rank != 1)
        params = list(model.named_parameters())
    elif case == "group-split":
        w, b = nn.Linear(3, 3).parameters()
        params = [{"params": [w, b]}] if rank == 0 else [{"params": [w]}, {"params": [b]}]
    else:
        params = list(nn.Linear(3, 3).named_parameters())
        kwargs = {
            "bucket-cap": dict(bucket_cap_mb=25 if rank == 0 else 1e-5),
            "topology": dict(topology="complete" if rank == 1 else "ring"),
            "global-avg": dict(global_avg_every=None if rank == 0 else 5),
            "compression": dict(compression=None if rank == 0 else "int8"),
            "local-world": dict(topology="alternating-exp-ring", local_world_size=1 + rank % 2),
            "bad-local-world": dict(local_world_size=2 if rank == 2 else 1),
            "bad-lr": dict(lr=-1.0 if rank == 1 else 0.1),
        }[case]
    return _attempt(dopt.DSGD, params, **{"lr": 0.1, **kwargs})


@pytest.mark.multiprocess
def test_parameter_order_named_names_the_first_parameter_that_differs():
    got = run_world(_build, 2, "order-named")
    _assert_same_error(
        got,
        "the ranks disagree on parameter 0",
        "rank 0: '0.weight', shape (3, 3)",
        "rank 1: '1.weight', shape (3, 3)",
        "sort them",
        kind="AgreementError",
    )


@pytest.mark.multiprocess
def test_parameter_order_unnamed_is_caught_by_the_shapes():
    got = run_world(_build, 3, "order-shapes")
    _assert_same_error(got, "parameter 0", "rank 0: shape (3,)", "ranks 1, 2: shape (4, 2)")


@pytest.mark.multiprocess
def test_strides_that_differ_are_caught():
    got = run_world(_build, 2, "strides")
    _assert_same_error(
        got, "parameter 0", "'weight'", "strides (27, 9, 3, 1)", "strides (27, 1, 9, 3)"
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "case, fragments",
    [
        ("requires-grad", ["parameter 1", "'bias'", "requires_grad=True", "requires_grad=False"]),
        ("group-split", ["param groups", "rank 0: 1; rank 1: 2"]),
        ("bucket-cap", ["bucket_cap_mb", "rank 0: 25.0; rank 1: 1e-05"]),
    ],
)
def test_bucket_layout_that_differs_is_caught(case, fragments):
    _assert_same_error(run_world(_build, 2, case), *fragments, kind="AgreementError")


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "case, n, fragments",
    [
        ("topology", 3, ["topology: ranks 0, 2: RingTopology", "rank 1: CompleteTopology"]),
        ("global-avg", 2, ["global_avg_every: rank 0: None; rank 1: 5"]),
        ("compression", 2, ["compression: rank 0: None; rank 1: 'int8'"]),
        ("local-world", 4, ["local_world_size: ranks 0, 2: 1; ranks 1, 3: 2"]),
    ],
)
def test_configuration_that_differs_is_caught(case, n, fragments):
    _assert_same_error(run_world(_build, n, case), *fragments, kind="AgreementError")


@pytest.mark.multiprocess
def test_an_error_of_one_rank_reaches_every_rank():
    got = run_world(_build, 3, "bad-local-world")
    _assert_same_error(
        got,
        "building DSGD failed on rank 2",
        "must be a multiple of local_world_size (2)",
        kind="ValueError",
    )
    got = run_world(_build, 2, "bad-lr")
    _assert_same_error(got, "failed on rank 1", "Invalid learning rate: -1.0", kind="ValueError")


def _numbered(rank, world_size):
    """Rank 1 counts an optimizer the others never built on the group (one whose construction
    it alone left, e.g. on an error it caught), then every rank builds one."""
    group = dist.new_group(list(range(world_size)))  # counted from 0: a group of this task
    if rank == 1:
        ParamOwner.number(group)
    return _attempt(dopt.DSGD, nn.Linear(3, 3).parameters(), lr=0.1, process_group=group)


@pytest.mark.multiprocess
def test_optimizers_built_in_another_number_are_caught():
    _assert_same_error(
        run_world(_numbered, 2),
        "the ranks disagree on optimizer number: rank 0: 0; rank 1: 1",
        "in the same order, on every rank",
        kind="AgreementError",
    )


def _collectives(rank, world_size):
    """How many all-gathers building an optimizer and loading its state take, when the ranks
    agree."""
    model = nn.Linear(3, 3)
    _together()
    counts = {"all_gather": 0, "all_gather_object": 0}
    originals = {name: getattr(dist, name) for name in counts}

    def counting(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    try:
        for name in counts:
            setattr(dist, name, counting(name))
        opt = dopt.DSGD(model.named_parameters(), lr=0.1)
        built = dict(counts)
        opt.load_state_dict(opt.state_dict())
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return built, counts


@pytest.mark.multiprocess
def test_the_check_costs_one_all_gather_when_the_ranks_agree():
    for built, after_load in run_world(_collectives, 2):
        assert built == {"all_gather": 1, "all_gather_object": 0}
        assert after_load == {"all_gather": 2, "all_gather_object": 0}


def test_the_message_groups_ranks_and_says_what_is_missing():
    accounts = [
        Account(items=[("a", "shape (2,)"), ("b", "shape (3,)")]),
        Account(items=[("a", "shape (2,)")]),
        Account(items=[("a", "shape (2,)"), ("b", "shape (3,)")]),
    ]
    message = explain(accounts, "building X")
    assert message is not None
    assert "parameter 1" in message
    assert "ranks 0, 2: 'b', shape (3,); rank 1: none (it has 1 parameters)" in message
    assert explain(accounts[:1] * 3, "building X") is None


# -- two optimizers on one process group ---------------------------------------------------------


def _gan(rank, world_size, topology, swap):
    """Two optimizers of equal shapes, stepped in another order on odd ranks when ``swap``."""
    torch.manual_seed(0)
    gen_model, disc_model = nn.Linear(4, 4), nn.Linear(4, 4)
    with torch.no_grad():  # equal shapes, different values: a mix-up would show
        disc_model.weight.add_(10.0)
    _together()
    opts = [
        dopt.DSGD(gen_model.parameters(), lr=0.1, topology=topology),
        dopt.DSGD(disc_model.parameters(), lr=0.1, topology=topology),
    ]
    models = [gen_model, disc_model]
    gen = torch.Generator().manual_seed(rank)
    for _ in range(6):
        for m in models:
            m.zero_grad()
            m(torch.randn(5, 4, generator=gen)).square().mean().backward()
        for k in [1, 0] if swap and rank % 2 else [0, 1]:
            opts[k].step()
    for o in opts:
        o.synchronize()
    return [nn.utils.parameters_to_vector(m.parameters()).detach() for m in models]


@pytest.mark.multiprocess
@pytest.mark.parametrize("topology, n", [("ring", 2), ("complete", 4)])
def test_two_optimizers_stepped_in_another_order_never_mix(topology, n):
    same = run_world(_gan, n, topology, False)
    swapped = run_world(_gan, n, topology, True)
    for rank in range(n):
        for k in range(2):
            assert torch.equal(swapped[rank][k], same[rank][k]), (rank, k)
    # and the gossip did mix each model with its own kind: G far from D's +10 offset
    assert all(v[0].abs().max() < 5 for v in same)


# -- checkpoints that do not belong together -----------------------------------------------------


def _ckpt_run(rank, world_size, ckpt_dir, save_at, sync_ranks, topology="ring", cls="DSGD"):
    """Train 6 steps; rank r saves its file after step ``save_at[r]`` (after synchronize() on
    ``sync_ranks``)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    _together()
    opt = getattr(dopt, cls)(model.parameters(), lr=0.05, topology=topology)
    gen = torch.Generator().manual_seed(rank)
    for t in range(1, 7):
        opt.zero_grad()
        model(torch.randn(4, 3, generator=gen)).square().mean().backward()
        opt.step()
        if t == save_at[rank]:
            if rank in sync_ranks:
                opt.synchronize()
            path = os.path.join(ckpt_dir, f"rank{rank}.pt")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    opt.synchronize()


def _ckpt_load(rank, world_size, ckpt_dir, kwargs=None):
    return _load(rank, ckpt_dir, **(kwargs or {}))


def _load(rank, ckpt_dir, shift=0, topology="ring", cls="DSGD", edit=None):
    """Load the file of rank ``(rank + shift) % files`` into a fresh optimizer."""
    files = len([f for f in os.listdir(ckpt_dir) if f.startswith("rank")])
    ckpt = torch.load(os.path.join(ckpt_dir, f"rank{(rank + shift) % files}.pt"), weights_only=True)
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    model.load_state_dict(ckpt["model"])
    _together()
    opt = getattr(dopt, cls)(model.parameters(), lr=0.05, topology=topology)
    if edit is not None:
        edit(rank, ckpt["opt"])
    outcome = _attempt(opt.load_state_dict, ckpt["opt"])
    if outcome[0] == "ok":
        outcome = (f"ok: step {opt.state_dict()['decent_optim']['step']}", outcome[1])
    return outcome


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "save_at, sync_ranks, fragments",
    [
        ({0: 3, 1: 5}, (), ["rank 0: 3 steps done", "rank 1: 5 steps done"]),
        (
            {0: 4, 1: 4},
            (1,),
            ["rank 0: 4 steps done, a round in flight", "rank 1: 4 steps done, no"],
        ),
    ],
    ids=["saved-at-different-steps", "synchronized-on-one-rank"],
)
def test_checkpoints_of_different_rounds_are_refused_on_every_rank(
    save_at, sync_ranks, fragments, tmp_path
):
    run_world(_ckpt_run, 2, str(tmp_path), save_at, sync_ranks)
    got = run_world(_ckpt_load, 2, str(tmp_path))
    _assert_same_error(got, "DSGD.load_state_dict: the ranks disagree on the round", *fragments)


def _drop_step(rank, state_dict):
    del state_dict["decent_optim"]["step"]


def _negative_step(rank, state_dict):
    state_dict["decent_optim"]["step"] = -3


def _shrink_exp_avg_on_rank_1(rank, state_dict):
    if rank == 1:
        state_dict["state"][0]["exp_avg"] = torch.zeros(3)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "kwargs, fragments",
    [
        (
            dict(shift=1),
            [
                "failed on ranks 0, 1",
                "rank 0 loaded the checkpoint saved by rank 1",
                "decent_optim.checkpoint.save(dir, model, opt, step=step)",
            ],
        ),
        (
            dict(topology="complete"),
            ["saved with topology RingTopology", "this optimizer has CompleteTopology"],
        ),
        (
            dict(edit=_drop_step),
            ["state_dict['decent_optim'] has no 'step'", "remove the entry"],
        ),
        (dict(edit=_negative_step), ["['step'] must count the completed steps", "-3"]),
        (
            dict(cls="DecentralizedAdam", edit=_shrink_exp_avg_on_rank_1),
            ["failed on rank 1", "'exp_avg' of the parameter of shape (2, 3)", "got (3,)"],
        ),
    ],
    ids=["another-ranks-file", "another-topology", "no-step", "negative-step", "wrong-shape"],
)
def test_a_checkpoint_that_is_not_this_ranks_is_refused_on_every_rank(kwargs, fragments, tmp_path):
    cls = kwargs.get("cls", "DSGD")
    run_world(_ckpt_run, 2, str(tmp_path), {0: 3, 1: 3}, (), "ring", cls)
    _assert_same_error(run_world(_ckpt_load, 2, str(tmp_path), kwargs), *fragments)


@pytest.mark.multiprocess
def test_a_checkpoint_of_another_world_size_is_refused(tmp_path):
    run_world(_ckpt_run, 2, str(tmp_path), {0: 3, 1: 3}, ())
    got = run_world(_ckpt_load, 4, str(tmp_path))
    _assert_same_error(got, "saved by a run of 2 ranks, this one has 4", kind="ValueError")


def _as_old_torch(rank, state_dict):
    """A torch.optim checkpoint of an older torch: integer steps, no decent_optim entry."""
    del state_dict["decent_optim"]
    for entry in state_dict["state"].values():
        entry["step"] = int(entry["step"])


@pytest.mark.multiprocess
def test_a_torch_checkpoint_with_integer_steps_loads(tmp_path):
    run_world(_ckpt_run, 2, str(tmp_path), {0: 3, 1: 3}, (), "ring", "DecentralizedAdam")
    kwargs = dict(cls="DecentralizedAdam", edit=_as_old_torch)
    got = run_world(_ckpt_load, 2, str(tmp_path), kwargs)
    assert [outcome for outcome, _ in got] == ["ok: step 3"] * 2, got


# -- a process group this rank is not in ---------------------------------------------------------


def _outside_group(rank, world_size):
    pair = dist.new_group([0, 1])  # every rank creates it; rank 2 gets a placeholder
    params = nn.Linear(3, 3).parameters()
    return _attempt(dopt.DSGD, params, lr=0.1, process_group=pair, local_world_size=1)


@pytest.mark.multiprocess
def test_a_process_group_without_this_rank_says_so():
    got = run_world(_outside_group, 3)
    assert [outcome for outcome, _ in got[:2]] == ["ok", "ok"], got
    outcome, seconds = got[2]
    assert outcome.startswith("ValueError: process_group does not contain this process"), outcome
    assert "global rank 2" in outcome and seconds < PROMPT_S

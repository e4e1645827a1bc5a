"""``compression="int8"`` resumes bit for bit: the public copies travel with the checkpoint.

Every rank is a node (``local_world_size=1``), so every exchange is compressed. Each run is
saved mid-run (a round in flight, or synchronized), resumed by new optimizers in a new task,
and compared with the uninterrupted run with ``torch.equal``. At another world size the copies
cannot carry over: they start over with exact values.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _harness import run_world
from _uneven import (
    PERIODS,
    SMALL_BUCKETS,
    build,
    mixing_step,
    resumed,
    save_or_resume,
    straight,
    train_step,
    vector,
)
from test_optim_multiprocess import _model

import decent_optim as dopt
from decent_optim import checkpoint


def _options(topology, local_steps, uneven, compression="int8", outer=None):
    """build()'s: every exchange compressed (a node per rank)."""
    return dict(
        topology=topology,
        bucket_cap_mb=SMALL_BUCKETS,
        local_steps=local_steps,
        uneven=uneven,
        compression=compression,
        outer=outer,
        local_world_size=1,
        timeout=60,
    )


def _run(
    rank,
    n,
    folder,
    topology,
    local_steps,
    uneven,
    save_at,
    sync,
    steps,
    resume,
    compression="int8",
    outer=None,
):
    """``steps`` steps; the uninterrupted run saves after ``save_at`` (after synchronize() with
    ``sync``), the resumed one starts from that file. Rounds of ``uneven=True`` are given time
    to arrive before each step, so that they are mixed where the step-locked schedule mixes."""
    model = _model()
    opt = build(model, **_options(topology, local_steps, uneven, compression, outer))
    path = Path(folder, f"rank{rank}.pt")
    before_save = (lambda opt: opt.synchronize()) if sync else None
    return save_or_resume(rank, model, opt, path, save_at, steps, resume, before_save)


CASES = [  # (topology, n, local_steps, uneven, save_at, sync)
    ("ring", 4, 1, False, 7, False),  # every-step gossip, a round in flight
    ("complete", 3, 1, False, 7, True),  # ... synchronized before saving
    ("complete", 3, 1, False, 8, False),  # groups of three parts
    ("ring", 4, 3, False, 7, False),  # local steps, mid-period
    ("ring", 2, 3, False, 6, False),  # ... right after a launch
    ("ring", 3, 3, True, 7, False),  # uneven=True, rounds in time
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("topology, n, local_steps, uneven, save_at, sync", CASES, ids=str)
def test_int8_resumes_bit_for_bit(topology, n, local_steps, uneven, save_at, sync, tmp_path):
    args = (str(tmp_path), topology, local_steps, uneven, save_at, sync, 16)
    first = run_world(_run, n, *args, False)
    again = run_world(_run, n, *args, True)
    assert not torch.equal(first[0], first[1]), "the ranks should differ"
    for a, b in zip(first, again):
        assert torch.equal(a, b)


@pytest.mark.multiprocess
@pytest.mark.parametrize("compression", ["rand1%+int4", "top1%+int2", "int2"])
@pytest.mark.parametrize(
    "case", [CASES[0], CASES[2], CASES[4], CASES[5]], ids=lambda c: "-".join(map(str, c))
)
def test_sparse_codecs_resume_bit_for_bit(case, compression, tmp_path):
    """The random positions come from the round and the bucket: a resumed run draws the same."""
    topology, n, local_steps, uneven, save_at, sync = case
    args = (str(tmp_path), topology, local_steps, uneven, save_at, sync, 16)
    straight = run_world(_run, n, *args, False, compression)
    resumed = run_world(_run, n, *args, True, compression)
    assert not torch.equal(straight[0], straight[1]), "the ranks should differ"
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


@pytest.mark.multiprocess
@pytest.mark.parametrize("uneven", [False, True])
def test_sparse_codecs_resume_bit_for_bit_with_a_slow_outer_step(uneven, tmp_path):
    # step-locked: every 6 steps (a multiple of local_steps); uneven=True: 5 DDP-equivalent steps
    outer = dopt.LocalOuterSGD(lr=0.6, momentum=0.7, every=5 if uneven else 6)
    args = (str(tmp_path), "ring", 3, uneven, 7, False, 16)  # 3 ranks, local_steps=3
    straight = run_world(_run, 3, *args, False, "rand1%+int4", outer)
    resumed = run_world(_run, 3, *args, True, "rand1%+int4", outer)
    assert not torch.equal(straight[0], straight[1]), "the ranks should differ"
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["checkpoint.load", "load_state_dict"])
def test_int8_resumes_bit_for_bit_with_really_uneven_ranks(how, tmp_path):
    options = dict(compression="int8", local_world_size=1)
    save_round, until = 3, 6
    first = run_world(straight, 2, str(tmp_path), PERIODS, save_round, until, options)
    for rank, (_, mixed_at, _, _) in enumerate(first):
        assert mixed_at == [mixing_step(PERIODS[rank], j) for j in range(1, until + 1)]
    counts = [saved["count"] for *_, saved in first]
    assert counts[0] > counts[1], counts
    again = run_world(resumed, 2, str(tmp_path), PERIODS, until, how, options)
    for (x, *_), (y, *_) in zip(first, again):
        assert torch.equal(x, y)


def _resize(rank, n, folder, stage, compression="int8"):
    """Stage "save": 3 ranks save a directory checkpoint mid-run; "load": 2 ranks resume it."""
    model = _model()
    opt = build(model, **_options("ring", 1, False, compression))
    root = Path(folder, "ckpt")
    if stage == "save":
        for t in range(5):
            train_step(model, opt, rank, t)
        checkpoint.save(root, model, opt, step=5)
        checkpoint.wait(root)
        return None
    checkpoint.load(root, model, opt)
    groups = opt.state_dict()["decent_optim"]["public_copies"]["groups"].values()
    primed = [g["primed"] for g in groups]  # after a resize: no public copies (exact values next)
    for t in range(5, 9):
        train_step(model, opt, rank, t)
    return primed, bool(torch.isfinite(vector(model)).all())


@pytest.mark.multiprocess
@pytest.mark.parametrize("compression", ["int8", "top1%+int2"])
def test_at_another_world_size_the_copies_start_over(compression, tmp_path):
    run_world(_resize, 3, str(tmp_path), "save", compression)
    for primed, finite in run_world(_resize, 2, str(tmp_path), "load", compression):
        assert primed == [False] and finite

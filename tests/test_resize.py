"""Resuming at another world size with ``decent_optim.checkpoint``: every optimizer, both ways.

A run of 4 ranks saves mid-flight (a gossip round in flight); it resumes at 2 ranks, at 1 and
back at 4 from 2. The values each rank starts from are checked against the saved files read
here independently (their float64 mean for ``"consensus"``, old rank ``r mod N``'s file for
``"rank"``), and at one rank the first step after the resize against torch.optim started from
the mean state. The refusals: another optimizer class, a file of another run in the folder.
"""

from __future__ import annotations

import gc
import shutil
from pathlib import Path

import pytest
import torch
from _harness import run_world
from _optimizers import EVERY_OPTIMIZER, TORCH_COUNTERPART
from torch import nn

import decent_optim as dopt
from decent_optim import checkpoint

OPTIMIZERS = [(cls, kw, TORCH_COUNTERPART.get(cls)) for cls, kw in EVERY_OPTIMIZER]
SAVED_STEP = 5


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _train(model: nn.Module, opt, steps: int, rank: int) -> None:
    gen = torch.Generator().manual_seed(100 + rank)  # every rank its own data
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(5, 6, generator=gen)
        model(x).pow(2).mean().backward()
        opt.step()


def _chosen(compression) -> list[int]:
    """Every optimizer; with compression (which only changes the gossip) one is enough."""
    return [2] if compression else list(range(len(OPTIMIZERS)))


def _save_all(rank: int, world_size: int, root: str, steps: int, compression) -> None:
    for index in _chosen(compression):
        cls, kw, _ = OPTIMIZERS[index]
        model = _model(0)
        opt = cls(model.parameters(), topology="ring", compression=compression, **kw)
        _train(model, opt, steps, rank)  # the last round is still in flight
        checkpoint.save(f"{root}/{index}", model, opt, step=steps, extra={"rank": rank})
        checkpoint.wait(f"{root}/{index}")  # rank 0 commits once every rank's file is there
        del opt
        gc.collect()


def _load_all(rank: int, world_size: int, root: str, rule: str, compression) -> list:
    results = []
    for index in _chosen(compression):
        cls, kw, _ = OPTIMIZERS[index]
        model = _model(1000 + rank)  # other start values: all must be replaced
        opt = cls(model.parameters(), topology="ring", compression=compression, **kw)
        resumed = checkpoint.load(f"{root}/{index}", model, opt, rule=rule)
        params = [p.detach().clone() for p in model.parameters()]
        state = opt.state_dict()
        moments = {
            k: {key: v.clone() for key, v in s.items() if key != "step"}
            for k, s in state["state"].items()
        }
        _train(model, opt, 3, rank)  # the gossip of the new world runs
        finite = all(bool(p.isfinite().all()) for p in model.parameters())
        results.append(
            (resumed.step, resumed.source, resumed.extra, params, moments, state["decent_optim"])
        )
        results[-1] += (finite,)
        del opt
        gc.collect()
    return results


def _saved(root: Path, index: int) -> list[dict]:
    folder = checkpoint.latest(root / str(index))
    assert folder is not None
    return [torch.load(folder[0] / name, weights_only=True) for name in folder[1].files]


def _mean(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([t.double() for t in tensors]).mean(0)


def _check(results: list, root: Path, rule: str, new_world: int, compression) -> None:
    for index, per_rank in zip(_chosen(compression), zip(*results)):
        files = _saved(root, index)
        old_world = len(files)
        for rank, (step, source, extra, params, moments, entry, finite) in enumerate(per_rank):
            assert (step, source, finite) == (SAVED_STEP, rule, True)
            assert entry["step"] == SAVED_STEP and entry["world_size"] == new_world
            chosen = [files[rank % old_world]] if rule == "rank" else files
            expected = [_mean([f["model"][k] for f in chosen]) for k in files[0]["model"]]
            for got, want in zip(params, expected):
                torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-7)
            for k, state in moments.items():
                for key, value in state.items():
                    want = _mean([f["optimizer"]["state"][k][key] for f in chosen])
                    torch.testing.assert_close(value.double(), want, rtol=1e-6, atol=1e-7)
            assert extra == {"rank": rank % old_world if rule == "rank" else 0}


@pytest.mark.multiprocess
@pytest.mark.parametrize("compression", [None, "int8"])
def test_shrink_4_to_2_and_grow_2_to_4(tmp_path, compression):
    run_world(_save_all, 4, str(tmp_path / "four"), SAVED_STEP, compression)
    _check(
        run_world(_load_all, 2, str(tmp_path / "four"), "consensus", compression),
        tmp_path / "four",
        "consensus",
        2,
        compression,
    )
    run_world(_save_all, 2, str(tmp_path / "two"), SAVED_STEP, compression)
    _check(
        run_world(_load_all, 4, str(tmp_path / "two"), "rank", compression),
        tmp_path / "two",
        "rank",
        4,
        compression,
    )


def _torch_reference(cls, kw, torch_cls, model: nn.Module, files: list[dict], grads):
    """One torch.optim step from the mean of the saved copies."""
    ref = _model(0)
    with torch.no_grad():
        for p, key in zip(ref.parameters(), files[0]["model"]):
            p.copy_(_mean([f["model"][key] for f in files]).float())
    kw = {k: v for k, v in kw.items() if k in ("lr", "weight_decay", "momentum")}
    opt = torch_cls(ref.parameters(), **kw)
    for k, p in enumerate(ref.parameters()):
        saved = files[0]["optimizer"]["state"][k]
        opt.state[p] = {
            key: (
                value.clone()
                if key == "step"
                else _mean([f["optimizer"]["state"][k][key] for f in files]).float()
            )
            for key, value in saved.items()
        }
    for p, g in zip(ref.parameters(), grads):
        p.grad = g.clone()
    opt.step()
    return [p.detach() for p in ref.parameters()]


@pytest.mark.multiprocess
def test_one_rank_resumes_a_run_of_four_like_torch_optim(tmp_path):
    run_world(_save_all, 4, str(tmp_path), SAVED_STEP, None)
    for index, (cls, kw, torch_cls) in enumerate(OPTIMIZERS):
        files = _saved(tmp_path, index)
        model = _model(7)
        opt = cls(model.parameters(), **kw)
        assert checkpoint.load(tmp_path / str(index), model, opt).saved_world_size == 4
        grads = [torch.randn_like(p) for p in model.parameters()]
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        opt.step()
        assert opt.state_dict()["decent_optim"]["step"] == SAVED_STEP + 1
        if torch_cls is None:
            continue
        want = _torch_reference(cls, kw, torch_cls, model, files, grads)
        for got, ref in zip(model.parameters(), want):
            torch.testing.assert_close(got.detach(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
def test_refuses_another_optimizer_and_files_of_another_run(tmp_path):
    run_world(_save_all, 2, str(tmp_path / "a"), SAVED_STEP, None)
    model = _model(0)
    with pytest.raises(ValueError, match="saved by DSGD, this optimizer is DecentralizedAdam"):
        checkpoint.load(tmp_path / "a" / "0", model, dopt.DecentralizedAdam(model.parameters()))
    # rank 1's file of another run of the same model and step, in place of this run's
    run_world(_save_all, 2, str(tmp_path / "b"), SAVED_STEP, None)
    theirs = checkpoint.latest(tmp_path / "b" / "1")
    ours = checkpoint.latest(tmp_path / "a" / "1")
    assert theirs is not None and ours is not None
    name = ours[1].files[1]
    torch.save(
        {
            **torch.load(theirs[0] / name, weights_only=True),
            "decent_optim_checkpoint": {
                **torch.load(theirs[0] / name, weights_only=True)["decent_optim_checkpoint"],
                "run": "zz",
            },
        },
        ours[0] / name,
    )
    ours[1].sizes[1] = (ours[0] / name).stat().st_size  # a manifest that agrees with the swap
    checkpoint.directory.commit_manifest(ours[0], ours[1])
    model = _model(0)
    with pytest.raises(ValueError, match="mixes files of different runs or steps"):
        checkpoint.load(
            tmp_path / "a" / "1", model, dopt.DecentralizedAdam(model.parameters(), lr=0.01)
        )
    shutil.rmtree(tmp_path)


def test_the_mean_holds_one_saved_copy_at_a_time(tmp_path):
    """Loading never holds all N copies: a file's tensors are freed before the next is read."""
    import weakref

    from decent_optim.checkpoint import resize

    alive: list[weakref.ref] = []
    most = 0

    def load(path):
        nonlocal most
        most = max(most, sum(ref() is not None for ref in alive))
        k = int(path)
        contents = {"w": torch.full((4,), float(k)), "step": torch.tensor(float(k)), "n": k}
        alive.append(weakref.ref(contents["w"]))
        return contents

    merged = resize.merged([str(k) for k in range(6)], rank=0, load=load)
    assert most == 0  # nothing of the previous file alive when the next is read
    assert torch.equal(merged["w"], torch.full((4,), 2.5))  # the mean of 0..5
    assert (
        merged["step"].item() == 5.0 and merged["n"] == 0
    )  # steps: the largest; the rest: rank 0's
    with pytest.raises(ValueError, match="rule must be one of"):
        resize.merged(["0"], rank=0, rule="newest", load=load)

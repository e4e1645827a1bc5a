"""What ``decent_optim.checkpoint.save`` refuses before writing, and what ``load`` refuses before
loading (issue 33, items 1, 3 and 4): a ``keep_last`` that would prune everything or is not a
whole number, an ``extra`` that ``load`` could not read back, and two models saving into one
folder. Every refusal leaves the checkpoints already saved as they were: the previous one
still loads, bit for bit.
"""

from __future__ import annotations

import gc
import importlib.util
from pathlib import Path

import pytest
import torch

import decent_optim as dopt
from decent_optim import checkpoint

needs_numpy = pytest.mark.skipif(
    importlib.util.find_spec("numpy") is None, reason="numpy is not installed"
)


def _model_and_opt(seed: int = 5, shape: tuple[int, int] = (6, 4)):
    torch.manual_seed(seed)
    model = torch.nn.Linear(*shape)
    return model, dopt.DecentralizedAdamW(model.parameters(), lr=0.1)


def _train(model, opt) -> None:
    opt.zero_grad()
    model(torch.randn(3, model.in_features)).square().mean().backward()
    opt.step()


def _files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_loads(root: Path, step: int, want: dict[str, torch.Tensor], shape=(6, 4)) -> None:
    model, opt = _model_and_opt(99, shape)
    assert checkpoint.load(root, model, opt).step == step
    for key, value in model.state_dict().items():
        assert torch.equal(value, want[key]), key


# -- item 1: keep_last -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "keep_last, error, says",
    [
        (0, ValueError, "would remove every checkpoint"),
        (-1, ValueError, "would remove every checkpoint"),
        (1.5, TypeError, "whole number >= 1"),
        (True, TypeError, "whole number >= 1"),
        ("2", TypeError, "whole number >= 1"),
    ],
)
def test_a_bad_keep_last_is_refused_before_anything_is_written(tmp_path, keep_last, error, says):
    model, opt = _model_and_opt()
    _train(model, opt)
    checkpoint.save(tmp_path, model, opt, step=1)
    saved, files = _state(model), _files(tmp_path)
    _train(model, opt)
    for background in (False, True):
        with pytest.raises(error, match=f"keep_last.*{says}|{says}.*keep_last") as info:
            checkpoint.save(
                tmp_path, model, opt, step=2, keep_last=keep_last, background=background
            )
        assert "nothing was written or removed" in str(info.value)
        assert checkpoint.wait(tmp_path) is None  # refused in the call, not in a thread
        assert _files(tmp_path) == files
    _assert_loads(tmp_path, 1, saved)


def test_keep_last_one_keeps_the_newest(tmp_path):
    model, opt = _model_and_opt()
    for step in (1, 2, 3):
        _train(model, opt)
        checkpoint.save(tmp_path, model, opt, step=step, keep_last=1)
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000003"]
    _assert_loads(tmp_path, 3, _state(model))


# -- item 3: extra that load would refuse --------------------------------------------------------


class _Position:
    """A user's object: not among what torch.load(weights_only=True) reads."""

    def __init__(self) -> None:
        self.batch = 7


def _bad_extras() -> list[tuple[object, str, str, str]]:
    """(extra, where, type named, part of the fix) of every refused case."""
    cases: list[tuple[object, str, str, str]] = [
        ({"data": _Position()}, "extra['data']", "_Position", "add_safe_globals"),
        ({"seen": {"a": [1, range(3)]}}, "extra['seen']['a'][1]", "builtins.range", "state_dict"),
    ]
    if importlib.util.find_spec("numpy") is not None:
        import numpy as np

        cases += [
            ({"rng": {"numpy": np.random.get_state()}}, "extra['rng']['numpy'][1]",
             "numpy.ndarray", ".tolist()"),
            ({"epoch": np.int64(3)}, "extra['epoch']", "numpy.int64", "int(x)"),
            ({"lr": np.float32(0.1)}, "extra['lr']", "numpy.float32", "float(x)"),
            ({np.int64(1): "first"}, "extra (the key ", "numpy.int64", "int(x)"),
        ]  # fmt: skip
    return cases


@pytest.mark.parametrize("case", range(len(_bad_extras())))
def test_an_extra_that_load_would_refuse_is_refused_at_save(tmp_path, case):
    extra, where, kind, fix = _bad_extras()[case]
    model, opt = _model_and_opt()
    checkpoint.save(tmp_path, model, opt, step=1, extra={"epoch": 0})
    saved, files = _state(model), _files(tmp_path)
    for background in (False, True):
        with pytest.raises(TypeError, match="load\\(\\) refuses") as info:
            checkpoint.save(tmp_path, model, opt, step=2, extra=extra, background=background)
        message = str(info.value)
        for part in (where, kind, fix, "weights_only=True", "Nothing was written"):
            assert part in message, (part, message)
        assert checkpoint.wait(tmp_path) is None
        assert _files(tmp_path) == files
    _assert_loads(tmp_path, 1, saved)


@needs_numpy
def test_the_numpy_fixes_the_message_names_load_back(tmp_path):
    import numpy as np

    model, opt = _model_and_opt()
    np.random.seed(3)
    state = np.random.get_state()
    extra = {
        "numpy": (state[0], state[1].tolist(), *state[2:]),  # as the message says
        "generator": np.random.default_rng(4).bit_generator.state,
        "epoch": int(np.int64(3)),
        "lr": float(np.float32(0.5)),
    }
    want = np.random.random(3)
    checkpoint.save(tmp_path, model, opt, step=1, extra=extra)
    resumed = checkpoint.load(tmp_path, *_model_and_opt(7))
    np.random.set_state(resumed.extra["numpy"])
    assert np.array_equal(np.random.random(3), want)
    assert resumed.extra["epoch"] == 3 and resumed.extra["lr"] == 0.5
    rng = np.random.default_rng()
    rng.bit_generator.state = resumed.extra["generator"]
    assert rng.random() == np.random.default_rng(4).random()


# -- item 4: two models in one folder ------------------------------------------------------------


@pytest.mark.parametrize("same_shape", [False, True])
@pytest.mark.parametrize("d_step", [1, 2])
def test_a_second_model_saving_into_the_folder_is_refused(tmp_path, same_shape, d_step):
    """A GAN: G and D, one optimizer class, one process; D of G's shape or not."""
    g, opt_g = _model_and_opt(1, (6, 4))
    d, opt_d = _model_and_opt(2, (6, 4) if same_shape else (4, 1))
    _train(g, opt_g)
    _train(d, opt_d)
    checkpoint.save(tmp_path, g, opt_g, step=1)
    saved, files = _state(g), _files(tmp_path)
    with pytest.raises(ValueError, match="another optimizer of this process") as info:
        checkpoint.save(tmp_path, d, opt_d, step=d_step)
    assert "folder of its own" in str(info.value) and "Nothing was written" in str(info.value)
    assert _files(tmp_path) == files
    _assert_loads(tmp_path, 1, saved)  # G's weights, not D's
    # each into a folder of its own: both load back
    checkpoint.save(tmp_path / "D", d, opt_d, step=1)
    _assert_loads(tmp_path / "D", 1, _state(d), (6, 4) if same_shape else (4, 1))


def test_an_existing_file_of_another_model_is_not_overwritten(tmp_path):
    """The other model's optimizer is gone (another process): its file tells the layouts apart."""
    d, opt_d = _model_and_opt(2, (4, 1))
    checkpoint.save(tmp_path, d, opt_d, step=1)
    saved, files = _state(d), _files(tmp_path)
    del opt_d
    gc.collect()
    g, opt_g = _model_and_opt(1, (6, 4))
    with pytest.raises(ValueError, match="already holds the checkpoint of another model") as info:
        checkpoint.save(tmp_path, g, opt_g, step=1)
    assert "'bias' has shape (1,) saved and (4,) here" in str(info.value)
    assert _files(tmp_path) == files
    _assert_loads(tmp_path, 1, saved, (4, 1))
    # the same model saving its step again is not refused
    d2, opt_d2 = _model_and_opt(3, (4, 1))
    checkpoint.load(tmp_path, d2, opt_d2)
    checkpoint.save(tmp_path, d2, opt_d2, step=1)


def test_loading_another_models_checkpoint_is_refused_before_anything_changes(tmp_path):
    d, opt_d = _model_and_opt(2, (4, 1))
    checkpoint.save(tmp_path, d, opt_d, step=1)
    g, opt_g = _model_and_opt(1, (6, 4))
    before, counter = _state(g), opt_g.state_dict()["decent_optim"]
    with pytest.raises(ValueError, match="was saved from another model") as info:
        checkpoint.load(tmp_path, g, opt_g)
    assert "'bias' has shape (1,) saved and (4,) here" in str(info.value)
    assert "folder of its own" in str(info.value)
    for key, value in g.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert opt_g.state_dict()["decent_optim"] == counter


# -- issue 39, item 2: save and load inside opt.averaged() -----------------------------------------


def test_a_save_inside_averaged_is_refused_and_after_the_block_saves_the_own_copy(tmp_path):
    """One rank: the refusal itself (the values a second rank would average in: test_checkpoint_
    ranks.py)."""
    model, opt = _model_and_opt()
    _train(model, opt)
    for background in (False, True):
        with opt.averaged(model):
            with pytest.raises(RuntimeError, match="checkpoint.save inside opt.averaged") as info:
                checkpoint.save(tmp_path, model, opt, step=1, background=background)
        for part in ("not its own", "after the block", "consensus_state_dict", "Nothing was"):
            assert part in str(info.value), (part, str(info.value))
    assert _files(tmp_path) == {}
    checkpoint.save(tmp_path, model, opt, step=1)  # what it says works
    _assert_loads(tmp_path, 1, _state(model))


def test_a_load_inside_averaged_is_refused_before_anything_changes(tmp_path):
    model, opt = _model_and_opt()
    _train(model, opt)
    checkpoint.save(tmp_path, model, opt, step=1)
    saved = _state(model)
    partial = tmp_path / "step-00000002"
    partial.mkdir()  # a save a kill interrupted: load would remove it
    fresh, fresh_opt = _model_and_opt(9)
    _train(fresh, fresh_opt)
    with fresh_opt.averaged(fresh):
        inside = _state(fresh)
        with pytest.raises(RuntimeError, match="checkpoint.load inside opt.averaged") as info:
            checkpoint.load(tmp_path, fresh, fresh_opt)
        assert "after the block" in str(info.value)
        for key, value in fresh.state_dict().items():
            assert torch.equal(value, inside[key]), key
    assert partial.is_dir()  # nothing was removed either
    assert checkpoint.load(tmp_path, fresh, fresh_opt).step == 1  # after the block: it loads
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, saved[key]), key


# -- issue 39, item 3: a file given where the checkpoint folder goes --------------------------------


def test_loading_from_a_torch_save_file_is_refused_naming_torch_load(tmp_path):
    model, opt = _model_and_opt()
    path = tmp_path / "model.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    fresh, fresh_opt = _model_and_opt(9)
    before = _state(fresh)
    with pytest.raises(NotADirectoryError, match="is a file, not a checkpoint folder") as info:
        checkpoint.load(path, fresh, fresh_opt)
    message = str(info.value)
    for part in (
        str(path),
        "checkpoint.save(root, ...) writes",
        "manifest.json",
        "written by torch.save",
        "torch.load(",
        "model.load_state_dict(",
    ):
        assert part in message, (part, message)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_loading_from_a_rank_file_names_its_root_and_step(tmp_path):
    model, opt = _model_and_opt()
    checkpoint.save(tmp_path / "ckpt", model, opt, step=7)
    rank_file = tmp_path / "ckpt" / "step-00000007" / "rank-00000-of-00001.pt"
    for given in (rank_file, rank_file.parent / "manifest.json"):
        with pytest.raises(NotADirectoryError, match="not a checkpoint folder") as info:
            checkpoint.load(given, *_model_and_opt(9))
        assert f"load('{(tmp_path / 'ckpt').resolve()}', model, opt, step=7)" in str(info.value)
    with pytest.raises(ValueError, match="not a checkpoint folder") as info:
        checkpoint.load(tmp_path / "ckpt" / "step-00000007", *_model_and_opt(9))
    assert "step=7" in str(info.value)  # a step folder is a folder, but not the root

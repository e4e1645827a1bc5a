"""Saving and loading a model under a decentralized optimizer, the ways users and frameworks do.

Every path must write every tensor, bit-equal, in no more bytes than the same model saved without
an optimizer, and load back, into a fresh model and into the model still under its optimizer
(which keeps training from the loaded values). Tied weights stay tied. Each path runs on a model
under each optimizer, at world size 1 and 2 (every rank saves its own model, as a decentralized
run does). The transformers/accelerate paths run in worker processes only: importing
transformers takes seconds, paid once per worker.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import zipfile

import pytest
import safetensors.torch as safetensors_torch
import torch
from _harness import run_world
from _optimizers import EVERY_OPTIMIZER
from torch import nn

import decent_optim as dopt

OPTIMIZERS = EVERY_OPTIMIZER
HF = ("transformers", "accelerate")


class Tied(nn.Module):
    """A small language model whose output head is its embedding (one Parameter, two names)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.body = nn.Sequential(nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 8), nn.LayerNorm(8))
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(self.body(self.emb(ids))), ids)


def _train(model: nn.Module, opt, steps: int, rank: int) -> None:
    gen = torch.Generator().manual_seed(100 + rank)  # every rank its own data
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randint(0, 16, (4,), generator=gen)).backward()
        opt.step()


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def _data_bytes(path: str) -> int:
    """Bytes of tensor data in a torch.save file (its ``data/`` records)."""
    with zipfile.ZipFile(path) as z:
        return sum(i.file_size for i in z.infolist() if "/data/" in i.filename)


def _load_under_optimizer(model: nn.Module, opt, rank: int, load, part=None, train=None) -> None:
    """Train on, then ``load()`` the values saved now back into ``part`` (default: ``model``).

    ``train(steps)`` trains ``model`` under ``opt`` (default: :func:`_train`).
    """
    part = model if part is None else part
    train = train or (lambda steps: _train(model, opt, steps, rank))
    saved = _state(part)
    pointers = [p.data_ptr() for p in model.parameters()]
    train(2)
    dopt.unwrap(opt).synchronize()  # writing parameters while a round sends them raises
    load()
    _assert_bit_equal(_state(part), saved)
    # still in the optimizer's buckets (same memory), and training goes on from there
    assert [p.data_ptr() for p in model.parameters()] == pointers
    train(1)


def _torch_paths(rank: int, world_size: int, tmp: str) -> list[str]:
    """torch.save and safetensors, for each optimizer; returns the paths checked."""
    return [name for cls, kw in OPTIMIZERS for name in _torch_paths_of(cls, kw, rank, tmp)]


def _torch_paths_of(cls, kw: dict, rank: int, tmp: str) -> list[str]:
    checked = []
    here = os.path.join(tmp, f"{cls.__name__}-rank{rank}")
    os.makedirs(os.path.join(here, "ref"))
    torch.manual_seed(0)
    model = Tied()
    plain = copy.deepcopy(model)  # the same model, never under an optimizer: the size bound
    opt = cls(model.parameters(), **kw)
    _train(model, opt, 3, rank)
    plain.load_state_dict(model.state_dict())
    assert model.head.weight is model.emb.weight

    # torch.save of the whole model and of a submodule: the same bytes as without optimizer
    for name in ("model", "body"):
        mine, ref = (m if name == "model" else m.body for m in (model, plain))
        # (torch.save names the records after the file: same name, other folder)
        path, ref_path = (os.path.join(here, d, name + ".pt") for d in ("", "ref"))
        torch.save(mine.state_dict(), path)
        torch.save(ref.state_dict(), ref_path)
        assert os.path.getsize(path) == os.path.getsize(ref_path), name
        tensors = {v.untyped_storage().data_ptr(): v.nbytes for v in ref.state_dict().values()}
        assert _data_bytes(path) == sum(tensors.values()), name
        loaded = torch.load(path)
        _assert_bit_equal(loaded, _state(mine))
    fresh = Tied()
    fresh.load_state_dict(torch.load(os.path.join(here, "model.pt")))
    _assert_bit_equal(_state(fresh), _state(model))
    assert fresh.head.weight is fresh.emb.weight
    path = os.path.join(here, "model.pt")
    _load_under_optimizer(model, opt, rank, lambda: model.load_state_dict(torch.load(path)))
    checked.append("torch.save")

    # safetensors.torch.save_model / load_model: one name per tied tensor, reloaded tied
    path = os.path.join(here, "model.safetensors")
    safetensors_torch.save_model(model, path)
    safetensors_torch.save_model(plain, os.path.join(here, "ref", "model.safetensors"))
    assert os.path.getsize(path) == os.path.getsize(os.path.join(here, "ref", "model.safetensors"))
    fresh = Tied()
    missing, unexpected = safetensors_torch.load_model(fresh, path)
    assert not missing and not unexpected
    _assert_bit_equal(_state(fresh), _state(model))
    assert fresh.head.weight is fresh.emb.weight
    _load_under_optimizer(
        model, opt, rank, lambda: safetensors_torch.load_model(model, path, strict=True)
    )
    checked.append("safetensors.save_model")

    # save_file(model.state_dict()) of the part without tied names (with them, safetensors
    # refuses shared tensors whether or not an optimizer holds the model: checked too)
    path = os.path.join(here, "body.safetensors")
    safetensors_torch.save_file(model.body.state_dict(), path)
    _assert_bit_equal(safetensors_torch.load_file(path), _state(model.body))
    _load_under_optimizer(
        model,
        opt,
        rank,
        lambda: model.body.load_state_dict(safetensors_torch.load_file(path)),
        part=model.body,
    )
    for m in (model, plain):
        with pytest.raises(RuntimeError, match="Some tensors share memory"):
            safetensors_torch.save_file(m.state_dict(), os.path.join(here, "tied.safetensors"))
    checked.append("safetensors.save_file")
    return checked


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [1, 2])
def test_torch_save_and_safetensors_write_every_tensor_once(world_size, tmp_path):
    results = run_world(_torch_paths, world_size, str(tmp_path))
    assert results == [["torch.save", "safetensors.save_model", "safetensors.save_file"] * 5] * (
        world_size
    )


# -- transformers and accelerate --------------------------------------------------------------------


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)  # randomly initialised, nothing downloaded


def _hf_train(model, opt, accelerator, steps: int, rank: int) -> None:
    gen = torch.Generator().manual_seed(200 + rank)
    for _ in range(steps):
        opt.zero_grad()
        ids = torch.randint(0, 64, (2, 8), generator=gen)
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()


def _hf_paths(rank: int, world_size: int, tmp: str) -> list[str]:
    """accelerate's save_model/save_state/load_state and save_pretrained, for each optimizer."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from transformers import GPT2LMHeadModel

    checked = []
    accelerator = Accelerator(cpu=True)
    try:
        pairs = []
        for cls, kw in OPTIMIZERS:
            model = _tiny_gpt2()
            plain = copy.deepcopy(model)
            opt = cls(model.parameters(), **kw)
            # prepare moves the model (.to(device)) after the optimizer was built: the next step
            # takes the parameters back into the optimizer's buckets
            wrapped, prepared = accelerator.prepare(model, opt)
            assert dopt.unwrap(prepared) is opt
            _hf_train(wrapped, prepared, accelerator, 2, rank)
            plain.load_state_dict(model.state_dict())
            pairs.append((cls.__name__, model, plain, wrapped, prepared))
        for name, model, plain, wrapped, prepared in pairs:
            here = os.path.join(tmp, f"{name}-rank{rank}")
            # accelerator.save_model: safetensors on the main process, tied names once
            accelerator.save_model(wrapped, os.path.join(here, "acc"))
            accelerator.save_model(plain, os.path.join(here, "acc-ref"))
            if accelerator.is_main_process:
                path = os.path.join(here, "acc", "model.safetensors")
                ref = os.path.join(here, "acc-ref", "model.safetensors")
                assert os.path.getsize(path) == os.path.getsize(ref)
                saved = safetensors_torch.load_file(path)
                assert len(saved) == len(model.state_dict()) - 1  # lm_head.weight is wte's
                fresh = GPT2LMHeadModel(model.config)
                fresh.load_state_dict(saved, strict=False)  # lm_head.weight: tied to wte
                _assert_bit_equal(_state(fresh), _state(model))
                checked.append("accelerator.save_model")
            # save_pretrained: under torch.distributed transformers writes rank 0's model only
            snapshot = _state(model)
            model.save_pretrained(os.path.join(here, "hf"))
            plain.save_pretrained(os.path.join(here, "hf-ref"))
            weights = os.path.join(here, "hf", "model.safetensors")
            if rank == 0:
                assert os.path.getsize(weights) == os.path.getsize(
                    os.path.join(here, "hf-ref", "model.safetensors")
                )
                fresh = GPT2LMHeadModel.from_pretrained(os.path.join(here, "hf"))
                _assert_bit_equal(_state(fresh), snapshot)
                assert fresh.lm_head.weight is fresh.transformer.wte.weight
                checked.append("save_pretrained")

            def load(weights=weights, snapshot=snapshot, model=model):
                if rank == 0:
                    model.load_state_dict(safetensors_torch.load_file(weights), strict=False)
                else:  # no file here: the values go back from memory
                    model.load_state_dict(snapshot)

            _load_under_optimizer(
                model,
                prepared,
                rank,
                load,
                train=lambda steps, w=wrapped, p=prepared: _hf_train(
                    w, p, accelerator, steps, rank
                ),
            )
            # the consensus model (a collective), written by rank 0
            consensus = dopt.unwrap(prepared).consensus_state_dict(model)
            # (a copy: save_pretrained deletes entries of the dict it is given)
            model.save_pretrained(os.path.join(here, "mean"), state_dict=dict(consensus))
            if rank == 0:
                fresh = GPT2LMHeadModel.from_pretrained(os.path.join(here, "mean"))
                _assert_bit_equal(_state(fresh), consensus)
                checked.append("save_pretrained(consensus)")
        # save_state / load_state: accelerate writes rank 0's models and optimizers (with one
        # rank, that rank's own: it resumes exactly)
        state_dir = os.path.join(tmp, "state")
        snapshots = [(_state(m), p.state_dict()["decent_optim"]) for _, m, _, _, p in pairs]
        accelerator.save_state(state_dir)
        accelerator.wait_for_everyone()
        for _, _, _, wrapped, prepared in pairs:
            _hf_train(wrapped, prepared, accelerator, 1, rank)
        if world_size > 1:
            # plain Accelerate hands rank 0's optimizer file to every rank: refused on every
            # rank, naming the adapter that keeps a file per rank (tested in test_integrations)
            with pytest.raises(ValueError, match="loaded the checkpoint saved by rank 0.*"
                               "DecentralizedAccelerator"):  # fmt: skip
                accelerator.load_state(state_dir)
            return [*checked, "load_state refused"]
        accelerator.load_state(state_dir)
        for i, ((name, model, _, wrapped, prepared), (values, counters)) in enumerate(
            zip(pairs, snapshots)
        ):
            suffix = "" if i == 0 else f"_{i}"
            saved = safetensors_torch.load_file(
                os.path.join(state_dir, f"model{suffix}.safetensors")
            )
            saved = {k.removeprefix("module."): v for k, v in saved.items()}  # DDP's names
            mine = _state(model)
            _assert_bit_equal({k: mine[k] for k in saved}, saved)
            assert model.lm_head.weight is model.transformer.wte.weight
            opt_file = torch.load(os.path.join(state_dir, f"optimizer{suffix}.bin"))
            assert prepared.state_dict()["decent_optim"] == opt_file["decent_optim"], name
            if rank == 0:  # the files hold what rank 0 had
                _assert_bit_equal(mine, values)
                assert opt_file["decent_optim"] == counters
            _hf_train(wrapped, prepared, accelerator, 1, rank)
            checked.append("save_state")
    finally:
        accelerator.free_memory()
        AcceleratorState._reset_state(reset_partial_state=True)
    return checked


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [1, 2])
def test_accelerate_and_save_pretrained_write_every_tensor(world_size, tmp_path):
    missing = [name for name in HF if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"needs the hf extra ({', '.join(missing)} not installed)")
    results = run_world(_hf_paths, world_size, str(tmp_path), timeout=600)
    on_rank0 = ["accelerator.save_model", "save_pretrained", "save_pretrained(consensus)"]
    if world_size == 1:
        assert sorted(results[0]) == sorted((on_rank0 + ["save_state"]) * 5)
    else:
        assert sorted(results[0]) == sorted(on_rank0 * 5 + ["load_state refused"])
        assert all(r == ["load_state refused"] for r in results[1:])

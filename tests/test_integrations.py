"""decent_optim.integrations: Hugging Face Trainer, Accelerate, Lightning, torch's local SGD.

Each framework is trained for real on 2 gloo ranks (tiny randomly initialised models, synthetic
data): train, checkpoint, resume in a new trainer, and the resumed losses and weights must equal
the uninterrupted run's bit for bit on every rank; evaluation and the exported model must be the
consensus (the mean over the ranks); and no DDP all-reduce may run (the model is not wrapped,
and the ranks' copies differ). The frameworks are imported inside the workers only, once per
worker pool (``from transformers import Trainer`` and ``import lightning`` take ~20 s each), and
a test skips when its extra (``hf``, ``lightning``) is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

import pytest
import torch
from _harness import run_world
from torch import nn

import decent_optim as dopt
from decent_optim.integrations import common

HAS_HF = all(importlib.util.find_spec(m) for m in ("transformers", "accelerate", "safetensors"))
HAS_LIGHTNING = importlib.util.find_spec("lightning") is not None
needs_hf = pytest.mark.skipif(not HAS_HF, reason="needs the hf extra: pip install decent-optim[hf]")
needs_lightning = pytest.mark.skipif(
    not HAS_LIGHTNING, reason="needs the lightning extra: pip install decent-optim[lightning]"
)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# -- shared helpers (torch only) -------------------------------------------------------------------


class _Wrapper:
    def __init__(self, inner, attribute):
        setattr(self, attribute, inner)

    def step(self, closure=None):  # wrappers forward step(); how unwrap tells one from data
        pass


def test_unwrap_finds_the_optimizer_behind_framework_wrappers():
    opt = dopt.DSGD(nn.Linear(2, 1).parameters(), lr=0.1)
    accelerated = _Wrapper(opt, "optimizer")  # Accelerate's AcceleratedOptimizer
    lightning = _Wrapper(accelerated, "_optimizer")  # Lightning's LightningOptimizer
    assert common.unwrap(lightning) is opt and common.unwrap(opt) is opt
    plain = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    assert common.unwrap(_Wrapper(plain, "optimizer")) is None and common.unwrap(None) is None
    assert common.decentralized([plain, accelerated]) == [opt]


def test_on_device_treats_cpu_and_cpu0_as_one_device():
    model = nn.Linear(2, 1)
    assert common.on_device(model, "cpu:0") and common.on_device(model, torch.device("cpu"))
    assert not common.on_device(model, "meta")


def test_a_missing_rank_file_names_the_world_size_to_resume_with(tmp_path):
    model = nn.Linear(2, 1)
    opt = dopt.DSGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    path = common.save_models_and_optimizers(tmp_path / "ckpt-", [model], [opt])
    assert path.name == "ckpt-rank0-of-1.pt"
    os.rename(path, tmp_path / "ckpt-rank0-of-4.pt")
    with pytest.raises(FileNotFoundError, match="this rank's is missing; the folder holds"):
        common.load_models_and_optimizers(tmp_path / "ckpt-", [model], [opt])


def test_rank_file_round_trip_restores_model_and_optimizer(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = dopt.DecentralizedAdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 3)).square().sum().backward()
        opt.step()
    common.save_models_and_optimizers(tmp_path / "x-", [model], [opt])
    saved, state = _params(model), opt.state_dict()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt.load_state_dict(dopt.DecentralizedAdamW(nn.Linear(3, 2).parameters()).state_dict())
    common.load_models_and_optimizers(tmp_path / "x-", [model], [opt])
    assert _same(_params(model), saved)
    assert opt.state_dict()["decent_optim"] == state["decent_optim"]
    with pytest.raises(ValueError, match="holds 1 model"):
        common.load_models_and_optimizers(tmp_path / "x-", [model, model], [opt])


# -- Hugging Face Trainer ------------------------------------------------------------------------


def _gpt2(seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config)


class _Tokens(torch.utils.data.Dataset):
    """Random token sequences; the model learns nothing useful, the trajectory is what counts."""

    def __init__(self, n, seed):
        self.ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _hf_trainer(out, mode, max_steps):
    from transformers import TrainingArguments

    from decent_optim.integrations.hf import DecentralizedTrainer

    class Recording(DecentralizedTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.losses.append(loss.item())
            return loss

    model = _gpt2()
    args = TrainingArguments(
        out, max_steps=max_steps, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        learning_rate=1e-3, lr_scheduler_type="linear", save_strategy="steps", save_steps=4,
        logging_steps=100, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
    )  # fmt: skip
    kwargs = {}
    if mode == "optimizer_cls_and_kwargs":
        kwargs[mode] = (dopt.DecentralizedAdamW, {"lr": 1e-3, "topology": "ring"})
    else:  # built by the user before the Trainer, with the model on its device already
        opt = dopt.DecentralizedAdamW(model.parameters(), lr=1e-3, topology="ring")
        kwargs["optimizers"] = (opt, None)
    trainer = Recording(
        model=model, args=args, train_dataset=_Tokens(64, 1), eval_dataset=_Tokens(16, 2), **kwargs
    )
    trainer.losses = []
    return trainer


def _hf_train_and_resume(rank, world_size, out, mode):
    import safetensors.torch
    from torch.nn.parallel import DistributedDataParallel

    first = _hf_trainer(out, mode, max_steps=8)
    first.train()
    opt = common.unwrap(first.optimizer)
    consensus = opt.consensus_state_dict(first.model)
    result = {
        "losses": first.losses,
        "params": _params(first.model),
        "ddp": isinstance(first.model_wrapped, DistributedDataParallel),
        "distance": opt.consensus_distance(),
        "eval_loss": first.evaluate()["eval_loss"],
    }
    # the consensus weights in a fresh model, evaluated by the stock Trainer
    from transformers import Trainer, TrainingArguments

    reference = _gpt2(seed=1)
    reference.load_state_dict(consensus)
    args = TrainingArguments(
        os.path.join(out, "reference"), per_device_eval_batch_size=4, report_to=[], use_cpu=True
    )
    stock = Trainer(model=reference, args=args, eval_dataset=_Tokens(16, 2))
    result["reference_eval_loss"] = stock.evaluate()["eval_loss"]
    first.save_model(os.path.join(out, "final"))  # rank 0 writes it
    torch.distributed.barrier()
    saved = safetensors.torch.load_file(os.path.join(out, "final", "model.safetensors"))
    result["saved_is_consensus"] = sorted(saved) == sorted(
        k
        for k in consensus
        if k != "lm_head.weight"  # tied to the embedding: saved once
    ) and all(torch.equal(saved[k], consensus[k]) for k in saved)

    second = _hf_trainer(out, mode, max_steps=8)
    second.train(resume_from_checkpoint=os.path.join(out, "checkpoint-4"))
    result["resumed_losses"], result["resumed_params"] = second.losses, _params(second.model)
    return result


@needs_hf
@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["optimizers", "optimizer_cls_and_kwargs"])
def test_hf_trainer_trains_resumes_exactly_and_evaluates_the_consensus(tmp_path, mode):
    results = run_world(_hf_train_and_resume, 2, str(tmp_path), mode, timeout=300)
    for rank, r in enumerate(results):
        assert len(r["losses"]) == 8 and not r["ddp"], rank
        assert r["distance"] > 0  # under DDP's all-reduce the copies would be identical
        assert r["resumed_losses"] == r["losses"][4:], rank  # bit for bit
        assert _same(r["resumed_params"], r["params"]), rank
        assert r["eval_loss"] == pytest.approx(r["reference_eval_loss"], rel=1e-5)
        assert r["saved_is_consensus"], rank
    assert results[0]["losses"] != results[1]["losses"]  # each rank its own batches
    assert results[0]["eval_loss"] == results[1]["eval_loss"]
    names = os.listdir(tmp_path / "checkpoint-4")
    assert {"decent_optim-rank0-of-2.pt", "decent_optim-rank1-of-2.pt"} <= set(names)


def _hf_refuses_a_torch_optimizer(rank, world_size, out):
    from transformers import TrainingArguments

    from decent_optim.integrations.hf import DecentralizedTrainer

    args = TrainingArguments(out, max_steps=1, report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = DecentralizedTrainer(model=_gpt2(), args=args, train_dataset=_Tokens(8, 1))
    return _type_error_of(trainer.train)


def _type_error_of(train) -> str:
    """The message of the TypeError ``train()`` raises, or "trained" when it raises none."""
    try:
        train()
    except TypeError as err:
        return str(err)
    return "trained"


@needs_hf
@pytest.mark.multiprocess
def test_hf_trainer_refuses_an_optimizer_that_would_train_each_rank_alone(tmp_path):
    for text in run_world(_hf_refuses_a_torch_optimizer, 2, str(tmp_path), timeout=300):
        assert "must be a decent_optim one, got AdamW" in text, text
        assert "optimizer_cls_and_kwargs=(decent_optim.DecentralizedAdamW" in text


# -- Accelerate ------------------------------------------------------------------------------------


def _accelerate_run(out, resume, safe):
    from accelerate.state import AcceleratorState

    from decent_optim.integrations.accelerate import DecentralizedAccelerator

    AcceleratorState._reset_state(reset_partial_state=True)  # another test's Accelerator
    accelerator = DecentralizedAccelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = dopt.DecentralizedAdamW(model.parameters(), lr=1e-2, topology="ring")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=gen)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    if resume:
        accelerator.load_state(out)
    losses = []
    for i, (xb, yb) in enumerate(loader):  # 16 micro-batches per rank, 8 optimizer steps
        if resume and i < 8:
            continue
        with accelerator.accumulate(model):
            loss = (model(xb) - yb).square().mean()
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        losses.append(loss.item())
        if not resume and i + 1 == 8:
            accelerator.save_state(out, safe_serialization=safe)
            saved_consensus = common.unwrap(opt).consensus_state_dict(model)
    result = {"losses": losses, "params": _params(model), "model": model}
    result["distance"] = common.unwrap(opt).consensus_distance()
    if not resume:
        result["saved_consensus"] = saved_consensus
    # end_training destroys the process group: no round may be in flight then (the world group
    # of the test's worker pool is kept, so the destruction is recorded instead)
    destroyed = result["in_flight_at_destroy"] = []
    inner = common.unwrap(opt)  # whether a round is in flight, as a checkpoint records it
    accelerator.state.destroy_process_group = lambda group=None: destroyed.append(
        inner.state_dict()["decent_optim"]["pending"]
    )
    accelerator.end_training()
    return result


def _accelerate_train_and_resume(rank, world_size, out, safe):
    import safetensors.torch
    from torch.nn.parallel import DistributedDataParallel

    first = _accelerate_run(out, resume=False, safe=safe)
    second = _accelerate_run(out, resume=True, safe=safe)
    if safe:
        saved = safetensors.torch.load_file(os.path.join(out, "model.safetensors"))
    else:
        saved = torch.load(os.path.join(out, "pytorch_model.bin"), weights_only=True)
    expected = first["saved_consensus"]
    return {
        "losses": first["losses"],
        "params": first["params"],
        "resumed_losses": second["losses"],
        "resumed_params": second["params"],
        "ddp": isinstance(first["model"], DistributedDataParallel),
        "saved_is_consensus": sorted(saved) == sorted(expected)
        and all(torch.equal(saved[k], expected[k]) for k in expected),
        "distance": first["distance"],
        "in_flight_at_destroy": first["in_flight_at_destroy"] + second["in_flight_at_destroy"],
    }


@needs_hf
@pytest.mark.multiprocess
@pytest.mark.parametrize("safe", [False, True])
def test_accelerate_prepare_accumulate_save_and_load_state_per_rank(tmp_path, safe):
    # safe: Accelerate's default, model.safetensors; else pytorch_model.bin (torch.save)
    results = run_world(_accelerate_train_and_resume, 2, str(tmp_path), safe, timeout=300)
    for rank, r in enumerate(results):
        assert len(r["losses"]) == 16 and not r["ddp"], rank
        assert r["resumed_losses"] == r["losses"][8:], rank
        assert _same(r["resumed_params"], r["params"]), rank
        assert r["saved_is_consensus"], rank
        assert r["distance"] > 0
        assert r["in_flight_at_destroy"] == [False, False], rank
    assert results[0]["losses"] != results[1]["losses"]


# -- HF Trainer and Accelerate: a checkpoint of 2 ranks resumed on 1 ---------------------------


def _mean_of_saved(files, index=0):
    """Each model tensor of the per-rank files, averaged in float64 (the independent reference)."""
    saved = [torch.load(f, weights_only=True) for f in files]
    models = [s["models"][index] for s in saved]
    mean = {k: sum(m[k].double() for m in models) / len(models) for k in models[0]}
    states = [s["optimizers"][index]["state"] for s in saved]
    exp_avg = {i: sum(st[i]["exp_avg"].double() for st in states) / len(states) for i in states[0]}
    return mean, exp_avg, saved


def _assert_loaded_the_mean(loaded, files):
    mean, exp_avg, saved = _mean_of_saved(files)
    assert set(loaded["params"]) <= set(mean)
    for name, value in loaded["params"].items():
        torch.testing.assert_close(value.double(), mean[name], rtol=1e-6, atol=1e-7)
        for s in saved:  # the copies differ, so the mean is no rank's own
            assert not torch.equal(s["models"][0][name], value), name
    for i, value in loaded["exp_avg"].items():
        torch.testing.assert_close(value.double(), exp_avg[i], rtol=1e-6, atol=1e-7)
    entry = loaded["entry"]
    assert entry["world_size"] == 1 and entry["rank"] == 0
    return saved


def _loaded(model, opt):
    """What the optimizer holds right after a load: its parameters (by name) and state."""
    opt = common.unwrap(opt)
    state = opt.state_dict()
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "exp_avg": {i: s["exp_avg"].clone() for i, s in state["state"].items()},
        "entry": state["decent_optim"],
    }


def _hf_resize(rank, world_size, out, resume):
    trainer = _hf_trainer(out, "optimizers", max_steps=8 if resume else 4)
    if not resume:  # a checkpoint at step 4 (save_steps=4), on every rank
        trainer.train()
        return None
    at_load = {}
    load = trainer._load_optimizer_and_scheduler

    def recording(checkpoint):
        load(checkpoint)
        if checkpoint is not None:
            at_load.update(_loaded(trainer.model, trainer.optimizer))

    trainer._load_optimizer_and_scheduler = recording
    trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-4"))
    entry = common.unwrap(trainer.optimizer).state_dict()["decent_optim"]
    return at_load, trainer.state.global_step, len(trainer.losses), entry


@needs_hf
@pytest.mark.multiprocess
def test_hf_trainer_resumes_two_ranks_checkpoint_on_one_from_their_mean(tmp_path):
    run_world(_hf_resize, 2, str(tmp_path), False, timeout=300)
    files = [tmp_path / "checkpoint-4" / f"decent_optim-rank{r}-of-2.pt" for r in range(2)]
    ((at_load, global_step, steps, entry),) = run_world(
        _hf_resize, 1, str(tmp_path), True, timeout=300
    )
    saved = _assert_loaded_the_mean(at_load, files)
    assert saved[0]["optimizers"][0]["decent_optim"]["step"] == 4
    assert at_load["entry"]["step"] == 4  # the round counter is kept
    # steps 5 to 8 on the one rank, from the checkpoint's global step
    assert global_step == 8 and steps == 4 and entry["step"] == 8 and entry["world_size"] == 1


def _accelerate_resize(rank, world_size, out, resume):
    from accelerate.state import AcceleratorState

    from decent_optim.integrations.accelerate import DecentralizedAccelerator

    AcceleratorState._reset_state(reset_partial_state=True)  # another test's Accelerator
    accelerator = DecentralizedAccelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = dopt.DecentralizedAdamW(model.parameters(), lr=1e-2, topology="ring")
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    at_load = None
    if resume:
        accelerator.load_state(out)
        at_load = _loaded(model, opt)
    for i, (xb, yb) in enumerate(loader):
        if i == 4:
            break
        opt.zero_grad()
        accelerator.backward((model(xb) - yb).square().mean())
        opt.step()
    if not resume:
        accelerator.save_state(out)
    entry = common.unwrap(opt).state_dict()["decent_optim"]
    # end_training destroys the process group; the worker pool's world group is kept
    accelerator.state.destroy_process_group = lambda group=None: None
    accelerator.end_training()
    return at_load, entry


@needs_hf
@pytest.mark.multiprocess
def test_accelerate_load_state_resumes_two_ranks_state_on_one_from_their_mean(tmp_path):
    run_world(_accelerate_resize, 2, str(tmp_path), False, timeout=300)
    files = [tmp_path / f"decent_optim-rank{r}-of-2.pt" for r in range(2)]
    ((at_load, entry),) = run_world(_accelerate_resize, 1, str(tmp_path), True, timeout=300)
    saved = _assert_loaded_the_mean(at_load, files)
    assert saved[0]["optimizers"][0]["decent_optim"]["step"] == 4
    assert at_load["entry"]["step"] == 4  # the round counter is kept
    assert entry["step"] == 8 and entry["world_size"] == 1  # 4 more steps on the one rank


# -- Lightning -------------------------------------------------------------------------------------


def _lightning_fit(out, epochs, ckpt_path=None, devices=2):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from decent_optim.integrations.lightning import DecentralizedStrategy

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
            self.losses = []

        def training_step(self, batch, index):
            x, y = batch
            loss = (self.net(x) - y).square().mean()
            self.losses.append(loss.item())
            return loss

        def on_train_epoch_end(self):  # fit's teardown mixes the last round: 2 ranks then agree
            self.distance = common.unwrap(self.trainer.optimizers[0]).consensus_distance()

        def validation_step(self, batch, index):
            x, y = batch
            self.log("val_loss", (self.net(x) - y).square().mean(), sync_dist=True)

        def configure_optimizers(self):
            opt = dopt.DecentralizedAdamW(self.parameters(), lr=1e-2, topology="ring")
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": sched}

    torch.manual_seed(0)
    module = Regression()
    trainer = L.Trainer(
        max_epochs=epochs, strategy=DecentralizedStrategy(), accelerator="cpu", devices=devices,
        callbacks=[ModelCheckpoint(dirpath=out, save_top_k=-1, every_n_epochs=1)],
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=out,
    )  # fmt: skip
    trainer.fit(module, _regression_data(1, 64), _regression_data(2, 16), ckpt_path=ckpt_path)
    return trainer, module


def _regression_data(seed, n):
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    return torch.utils.data.DataLoader(data, batch_size=4)


def _lightning_train_and_resume(rank, world_size, out):
    from torch.nn.parallel import DistributedDataParallel

    trainer, module = _lightning_fit(out, epochs=3)
    opt = common.unwrap(trainer.optimizers[0])
    in_flight_after_fit = opt.state_dict()["decent_optim"][
        "pending"
    ]  # Lightning may destroy the group at exit
    consensus = opt.consensus_state_dict(module)
    reference = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    reference.load_state_dict({k[len("net.") :]: v for k, v in consensus.items()})
    x, y = _regression_data(2, 16).dataset.tensors
    with torch.no_grad():
        reference_val = (reference(x) - y).square().mean().item()
    last = torch.load(os.path.join(out, "epoch=2-step=24.ckpt"), weights_only=False)
    result = {
        "losses": module.losses,
        "params": _params(module),
        "ddp": isinstance(trainer.strategy.model, DistributedDataParallel),
        "in_flight_after_fit": in_flight_after_fit,
        "distance": module.distance,
        "val_loss": trainer.callback_metrics["val_loss"].item(),
        "reference_val_loss": reference_val,
        "saved_is_consensus": all(
            torch.equal(last["state_dict"][k], v) for k, v in consensus.items()
        ),
    }
    # resume at an epoch boundary: Lightning's own mid-epoch resume is not exact, with DDP too
    trainer, module = _lightning_fit(
        out, epochs=3, ckpt_path=os.path.join(out, "epoch=1-step=16.ckpt")
    )
    result["resumed_losses"], result["resumed_params"] = module.losses, _params(module)
    return result


@needs_lightning
@pytest.mark.multiprocess
def test_lightning_strategy_trains_resumes_exactly_and_validates_the_consensus(tmp_path):
    results = run_world(_lightning_train_and_resume, 2, str(tmp_path), timeout=300)
    for rank, r in enumerate(results):
        assert len(r["losses"]) == 24 and not r["ddp"] and not r["in_flight_after_fit"], rank
        assert r["distance"] > 0
        assert r["resumed_losses"] == r["losses"][16:], rank
        assert _same(r["resumed_params"], r["params"]), rank
        assert r["val_loss"] == pytest.approx(r["reference_val_loss"], rel=1e-5)
        assert r["saved_is_consensus"], rank
    assert results[0]["losses"] != results[1]["losses"]
    names = set(os.listdir(tmp_path))
    assert {"epoch=1-step=16.ckpt.rank0-of-2.pt", "epoch=1-step=16.ckpt.rank1-of-2.pt"} <= names


def _lightning_refuses_a_torch_optimizer(rank, world_size, out):
    import lightning as L

    from decent_optim.integrations.lightning import DecentralizedStrategy

    class Plain(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(8, 1)

        def training_step(self, batch, index):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    trainer = L.Trainer(
        max_epochs=1, strategy=DecentralizedStrategy(), accelerator="cpu", devices=2,
        logger=False, enable_progress_bar=False, enable_checkpointing=False, default_root_dir=out,
    )  # fmt: skip
    return _type_error_of(lambda: trainer.fit(Plain(), _regression_data(1, 16)))


@needs_lightning
@pytest.mark.multiprocess
def test_lightning_strategy_refuses_an_optimizer_that_would_train_each_rank_alone(tmp_path):
    for text in run_world(_lightning_refuses_a_torch_optimizer, 2, str(tmp_path), timeout=300):
        assert "configure_optimizers must return a decent_optim optimizer" in text, text
        assert "got AdamW" in text


def _lightning_ddp_with_our_optimizer(rank, world_size, out):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class Decentralized(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net, self.steps = nn.Linear(8, 1), 0

        def training_step(self, batch, index):
            self.steps += 1
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return dopt.DecentralizedAdamW(self.parameters(), lr=1e-2)

    module = Decentralized()
    trainer = L.Trainer(
        max_epochs=1, strategy=DDPStrategy(), accelerator="cpu", devices=2,
        logger=False, enable_progress_bar=False, enable_checkpointing=False, default_root_dir=out,
    )  # fmt: skip
    return _type_error_of(lambda: trainer.fit(module, _regression_data(1, 16))), module.steps


@needs_lightning
@pytest.mark.multiprocess
def test_lightning_ddp_strategy_with_a_decentralized_optimizer_is_refused_at_setup(tmp_path):
    # DDP would all-reduce the gradients under the gossip and checkpoint rank 0's state only
    for text, steps in run_world(_lightning_ddp_with_our_optimizer, 2, str(tmp_path), timeout=300):
        assert "decent_optim.integrations.lightning.DecentralizedStrategy()" in text, text
        assert "built under Lightning's DDPStrategy" in text and steps == 0, (text, steps)


# -- torch's PostLocalSGDOptimizer with a gossip averager --------------------------------------------


def _local_sgd_with_gossip(rank, world_size):
    from torch.distributed.optim import PostLocalSGDOptimizer

    from decent_optim.gossip import GossipAverager

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    averager = GossipAverager(period=2, warmup_steps=1, topology="ring")
    opt = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), averager)
    gen = torch.Generator().manual_seed(rank)
    before, after = [], []
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(4, 3, generator=gen)).square().mean().backward()
        opt.optim.step()  # the local step alone, to see what the averager does
        before.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        averager.average_parameters(opt.param_groups)
        after.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return before, after, opt.state_dict()["step"]


@pytest.mark.multiprocess
def test_gossip_averager_mixes_with_the_rounds_neighbours_every_period_after_warmup():
    world = 4
    results = run_world(_local_sgd_with_gossip, world)
    topo = dopt.topologies.get("ring", world)
    for step in range(5):
        due = step >= 1 and (step - 1) % 2 == 0
        for rank, (before, after, counter) in enumerate(results):
            assert counter == 5
            if not due:
                assert torch.equal(after[step], before[step])
                continue
            weights = topo.weights(rank, (step - 1) // 2)
            expected = sum(w * results[j][0][step] for j, w in weights.items())
            torch.testing.assert_close(after[step], expected)


def test_gossip_averager_needs_a_process_group_and_a_valid_period():
    from decent_optim.gossip import GossipAverager

    with pytest.raises(ValueError, match="period must be a positive int, got 0"):
        GossipAverager(period=0)
    with pytest.raises(RuntimeError, match="init_process_group"):
        GossipAverager(period=1)


def _save_rank_files(rank, world_size, out):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = dopt.DecentralizedAdamW(model.parameters(), lr=0.1, topology="ring")
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 3, generator=gen)).square().sum().backward()
        opt.step()
    common.save_models_and_optimizers(os.path.join(out, "x-"), [model], [opt])


@pytest.mark.multiprocess
def test_rank_files_of_two_ranks_resume_on_one_from_their_mean(tmp_path):
    """The adapters' own checkpoints (HF Trainer, Accelerate) at another world size."""
    run_world(_save_rank_files, 2, str(tmp_path))
    saved = [torch.load(tmp_path / f"x-rank{r}-of-2.pt", weights_only=True) for r in range(2)]
    model = nn.Linear(3, 2)
    opt = dopt.DecentralizedAdamW(model.parameters(), lr=0.1)
    common.load_models_and_optimizers(tmp_path / "x-", [model], [opt])
    for key, value in model.state_dict().items():
        mean = (saved[0]["models"][0][key].double() + saved[1]["models"][0][key].double()) / 2
        torch.testing.assert_close(value.double(), mean, rtol=1e-6, atol=1e-7)
    state = opt.state_dict()
    assert state["decent_optim"]["step"] == 3 and state["decent_optim"]["world_size"] == 1
    exp_avg = [s["optimizers"][0]["state"][0]["exp_avg"].double() for s in saved]
    torch.testing.assert_close(state["state"][0]["exp_avg"].double(), sum(exp_avg) / 2)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()  # training goes on at the new size
    shutil.copy(tmp_path / "x-rank1-of-2.pt", tmp_path / "x-rank0-of-2.pt")  # one rank's, twice
    with pytest.raises(ValueError, match="holds the optimizer state of rank 1 of 2, not of rank 0"):
        common.load_models_and_optimizers(tmp_path / "x-", [model], [opt])


def _lightning_fit_at(rank, world_size, out, epochs, ckpt_path):
    trainer, module = _lightning_fit(out, epochs, ckpt_path, devices=world_size)
    opt = common.unwrap(trainer.optimizers[0])
    return opt.state_dict()["decent_optim"], len(module.losses)


@needs_lightning
@pytest.mark.multiprocess
def test_lightning_strategy_resumes_two_ranks_checkpoint_on_one(tmp_path):
    run_world(_lightning_fit_at, 2, str(tmp_path), 1, None)
    ckpt = str(tmp_path / "epoch=0-step=8.ckpt")
    saved = [torch.load(f"{ckpt}.rank{r}-of-2.pt", weights_only=True) for r in range(2)]
    ((entry, losses),) = run_world(_lightning_fit_at, 1, str(tmp_path / "one"), 2, ckpt)
    # one more epoch on one rank (16 batches of the 64 samples), from the round counter saved
    assert losses == 16 and entry["world_size"] == 1 and entry["step"] == 8 + 16
    assert saved[0]["optimizer_states"][0]["decent_optim"]["step"] == 8

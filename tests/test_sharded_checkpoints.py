"""Checkpoints of FSDP2-sharded replicas: DCP's save over several replicas refused, a resume after a
real kill, a per-replica checkpoint into another shard count, Lightning's ModelParallelStrategy
(refused) and DecentralizedModelParallelStrategy (one checkpoint per replica).

The model, the mesh and the training steps are those of ``tests/test_sharded.py``; the reference
is always the uninterrupted run, compared bit for bit in float64 (the optimizer state after
resharding: within 1e-12).
"""

from __future__ import annotations

import copy
import importlib.util
import os
import signal

import pytest
import torch
from _harness import WorldError, run_world, run_world_fresh
from test_sharded import _build, _full, _steps

import decent_optim
from decent_optim.optim.checkpoint import KEY

multiprocess = pytest.mark.multiprocess
needs_lightning = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None, reason="needs the lightning extra"
)

_STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")


def _full_state(model, opt) -> list[list[torch.Tensor]]:
    """Every parameter's optimizer state, as whole tensors (a collective over the shards)."""
    return [[_full_tensor(opt.state[p][k]) for k in _STATE_KEYS] for p in model.parameters()]


def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))


def _dcp_state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _dcp_save_replica(model, opt, mesh, path: str, replica: int) -> None:
    import torch.distributed.checkpoint as dcp

    group = mesh["shard"].get_group()
    dcp.save(_dcp_state(model, opt), checkpoint_id=f"{path}/replica{replica}", process_group=group)


def _dcp_load_replica(model, opt, mesh, path: str, replica: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _dcp_state(model, opt)
    group = mesh["shard"].get_group()
    dcp.load(state, checkpoint_id=f"{path}/replica{replica}", process_group=group)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


# -- a save over several replicas ------------------------------------------------------------------


def _save_over(rank, world, path, how):
    import torch.distributed.checkpoint as dcp

    model, opt, _ = _build()
    _steps(model, opt, rank // 2, 0, 2)
    try:
        if how == "world":
            dcp.save(_dcp_state(model, opt), checkpoint_id=path)
        elif how == "async":  # planned in a thread of this process
            dcp.async_save(_dcp_state(model, opt), checkpoint_id=path).result()
        elif how == "averaged, with the optimizer":  # the optimizer states are not averaged
            with opt.averaged(model):
                dcp.save(_dcp_state(model, opt), checkpoint_id=path)
        else:  # a replica's shard 0 with the other replica's shard 1
            import torch.distributed as dist

            crossed = [dist.new_group([0, 3]), dist.new_group([1, 2])]
            which = 0 if rank in (0, 3) else 1
            dcp.save(
                _dcp_state(model, opt), checkpoint_id=f"{path}{which}", process_group=crossed[which]
            )
    except BaseException as err:  # DCP raises CheckpointException, a BaseException
        return type(err).__name__, str(err)
    return None


@multiprocess
@pytest.mark.parametrize("how", ["world", "async", "averaged, with the optimizer", "crossed"])
def test_a_save_over_several_replicas_is_refused_on_every_rank_before_writing(how, tmp_path):
    results = run_world(_save_over, 4, str(tmp_path / "ckpt"), how)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} saved a mix of replicas"
        name, message = result
        assert name == "CheckpointException", result
        assert "more than one replica of the model" in message, message
        assert "process_group=mesh['shard'].get_group()" in message, message
        assert "opt.averaged(model)" in message, message
    written = [f for _, _, files in os.walk(tmp_path) for f in files]
    assert written == [], written


def _one_replica(rank, world, path, phase):
    # one replica of 4 shards: a save over all ranks is a save of the replica
    model, opt, mesh = _build(1, 4)
    if phase == "save":
        import torch.distributed.checkpoint as dcp

        _steps(model, opt, 0, 0, 3)
        dcp.save(_dcp_state(model, opt), checkpoint_id=path)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = _dcp_state(model, opt)
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _steps(model, opt, 0, 3, 2)
    return _full(model), _full_state(model, opt)


@multiprocess
def test_one_replica_still_saves_over_all_ranks(tmp_path):
    straight = run_world(_one_replica, 4, str(tmp_path), "save")
    resumed = run_world(_one_replica, 4, str(tmp_path), "load")
    assert _equal(straight, resumed)


def _outside_dcp(rank, world, path):
    model, opt, _ = _build()
    _steps(model, opt, rank // 2, 0, 2)
    saved = opt.state_dict()
    guard = saved["param_groups"][0][KEY]["replica"]
    deep = copy.deepcopy(saved)["param_groups"][0][KEY]["replica"]
    torch.save(saved, f"{path}/rank{rank}.pt")
    loaded = torch.load(f"{path}/rank{rank}.pt", weights_only=True)  # no class of ours in it
    opt.load_state_dict(loaded)
    _steps(model, opt, rank // 2, 2, 1)
    plain = decent_optim.DecentralizedAdamW(torch.nn.Linear(2, 1).parameters())
    return (
        int(guard),
        type(deep) is type(guard),
        loaded["param_groups"][0][KEY]["replica"],
        KEY in plain.state_dict()["param_groups"][0],
    )


@multiprocess
def test_the_guard_is_a_plain_number_outside_dcp(tmp_path):
    for rank, (guard, kept, stored, plain) in enumerate(run_world(_outside_dcp, 4, str(tmp_path))):
        assert guard == rank // 2 and kept
        assert isinstance(stored, torch.Tensor) and int(stored) == rank // 2
        assert not plain  # an unsharded optimizer's state dict is unchanged


# -- a resume after a kill ---------------------------------------------------------------------------


def _trained(rank, world, steps):
    model, opt, _ = _build()
    _steps(model, opt, rank // 2, 0, steps)
    return _full(model), _full_state(model, opt)


def _killed(rank, world, path, saved_at, kill_at):
    """Train, checkpoint both ways at ``saved_at``, train on; rank 0 SIGKILLs itself after step
    ``kill_at`` (a round in flight), and the harness SIGKILLs the others, blocked on it."""
    model, opt, mesh = _build()
    replica = rank // 2
    _steps(model, opt, replica, 0, saved_at)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"{path}/rank{rank}.pt")
    _dcp_save_replica(model, opt, mesh, path, replica)
    _steps(model, opt, replica, saved_at, kill_at - saved_at)
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    _steps(model, opt, replica, kill_at, 100)
    return "not killed"


def _resumed(rank, world, path, how, saved_at, steps):
    model, opt, mesh = _build()
    if how == "torch.save":
        saved = torch.load(f"{path}/rank{rank}.pt", weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    else:
        _dcp_load_replica(model, opt, mesh, path, rank // 2)
    _steps(model, opt, rank // 2, saved_at, steps - saved_at)
    return _full(model), _full_state(model, opt)


@multiprocess
def test_resume_after_a_kill_is_bit_exact(tmp_path):
    saved_at, kill_at, steps = 3, 5, 7
    with pytest.raises(WorldError) as killed:
        run_world_fresh(_killed, 4, str(tmp_path), saved_at, kill_at, timeout=60)
    assert "exit code -9" in killed.value.failures[0], killed.value.failures
    straight = run_world(_trained, 4, steps)
    for how in ("torch.save", "dcp"):
        resumed = run_world_fresh(_resumed, 4, str(tmp_path), how, saved_at, steps)
        for rank in range(4):
            assert _equal(resumed[rank], straight[rank]), (how, rank)


# -- another shard count ---------------------------------------------------------------------------


def _into_shards(rank, world, path, shards):
    """2 replicas x 2 shards save per replica at step 3 and go on to step 6; or 2 replicas x
    ``shards`` shards resume from those checkpoints and go on to step 6."""
    replica = rank // shards
    if shards == 2:
        model, opt, mesh = _build(2, 2)
        _steps(model, opt, replica, 0, 3)
        _dcp_save_replica(model, opt, mesh, path, replica)
    else:
        model, opt, mesh = _build(2, shards)
        _dcp_load_replica(model, opt, mesh, path, replica)
        assert opt.state_dict()["decent_optim"]["step"] == 3
    _steps(model, opt, replica, 3, 3)
    return replica, _full(model), _full_state(model, opt)


@multiprocess
@pytest.mark.parametrize("shards", [1, 4])
def test_a_replica_checkpoint_resumes_at_another_shard_count(shards, tmp_path):
    straight = run_world(_into_shards, 4, str(tmp_path), 2)
    resumed = run_world(_into_shards, 2 * shards, str(tmp_path), shards)
    for replica, params, state in resumed:
        _, want_params, want_state = straight[2 * replica]
        worst = max(float((a - b).abs().max()) for a, b in zip(params, want_params))
        worst_state = max(
            float((a - b).abs().max()) for x, y in zip(state, want_state) for a, b in zip(x, y)
        )
        print(
            f"replica {replica}: max |params - uninterrupted| = {worst:.3g}, state {worst_state:.3g}"
        )
        assert worst <= 1e-12 and worst_state <= 1e-12


def _from_one_copy(rank, world, path):
    """2 x 2 save per replica at step 3 and return what they saved; or every replica resumes
    from replica 0's checkpoint -- refused, then asked for -- returns the refusal and what it
    loaded, and takes a step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, opt, mesh = _build()
    if path.endswith("save"):
        _steps(model, opt, rank // 2, 0, 3)
        _dcp_save_replica(model, opt, mesh, path, rank // 2)
        return _full(model), _full_state(model, opt)
    state = _dcp_state(model, opt)
    dcp.load(
        state,
        checkpoint_id=path.replace("load", "save/replica0"),
        process_group=mesh["shard"].get_group(),
    )
    try:
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        refusal = None
    except ValueError as err:
        refusal = str(err)
    del state["optim"]["param_groups"][0][KEY]["replica"]  # replica 0's state, on purpose
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = _full(model), _full_state(model, opt)
    _steps(model, opt, rank // 2, 3, 1)
    return refusal, loaded


@multiprocess
def test_every_replica_restarts_from_one_replicas_checkpoint_when_asked(tmp_path):
    saved = run_world(_from_one_copy, 4, str(tmp_path / "save"))
    loaded = run_world(_from_one_copy, 4, str(tmp_path / "load"))
    assert not _equal(saved[0][0], saved[2][0])  # the replicas differed when saved
    for rank, (refusal, values) in enumerate(loaded):
        # unasked, replica 1 loading replica 0's state is refused on every rank
        assert refusal is not None and "replica 1 of 2 loaded the optimizer state saved by " \
            "replica 0" in refusal, refusal  # fmt: skip
        assert _equal(values, saved[rank % 2])  # replica 0's shard of the same index


# -- a full state dict saved on rank 0 and loaded everywhere ------------------------------------------


def _gathered_on_rank_0(model, opt, how):
    """The optimizer's state as a whole, the way scripts keep one file for a sharded model
    (pytorch/examples' FSDP2 checkpointer): through torch's state-dict tools, or each DTensor's
    full_tensor(); rank 0's is written."""
    if how == "get_optimizer_state_dict":
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(model, opt, options=whole)
    saved = opt.state_dict()
    state = {
        index: {k: _full_tensor(v) for k, v in entry.items()}
        for index, entry in saved["state"].items()
    }
    return {"param_groups": saved["param_groups"], "state": state}


def _loaded_on_every_rank(model, opt, whole, how):
    """Load rank 0's whole state into this rank's optimizer, as those scripts resume."""
    if how == "get_optimizer_state_dict":
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_optimizer_state_dict(model, opt, optim_state_dict=whole, options=options)
        return
    from torch.distributed.tensor import DTensor, distribute_tensor

    mine = opt.state_dict()
    for group, saved in zip(mine["param_groups"], whole["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})
    for index, entry in mine["state"].items():
        for k, v in whole["state"][index].items():
            if isinstance(entry[k], DTensor):
                v = distribute_tensor(v, entry[k].device_mesh, entry[k].placements)
            entry[k] = v
    opt.load_state_dict({"param_groups": mine["param_groups"], "state": mine["state"]})


def _one_file_for_all(rank, world, path, how):
    """Save at step 2 both ways -- rank 0's whole state, and every rank's own file -- then load
    rank 0's on every rank (refused), then resume from the rank's own file as
    docs/migrating_from_ddp.rst does (the model before the optimizer is built) for step 3."""
    import torch.distributed as dist
    from test_sharded import _model, _shard

    model, opt, _ = _build()
    _steps(model, opt, rank // 2, 0, 2)
    whole = _gathered_on_rank_0(model, opt, how)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"{path}.rank{rank}.pt")
    if rank == 0:
        torch.save(whole, path)
    dist.barrier()
    model, opt, _ = _build()
    before = _full_state(model, opt)
    try:
        _loaded_on_every_rank(model, opt, torch.load(path, weights_only=True), how)
        refused, untouched = None, False
    except ValueError as err:
        refused, untouched = str(err), _equal(before, _full_state(model, opt))
    model = _model()
    mesh = _shard(model, 2, 2)
    saved = torch.load(f"{path}.rank{rank}.pt", weights_only=True)
    model.load_state_dict(saved["model"])
    opt = decent_optim.DecentralizedAdamW(
        model.parameters(), lr=1e-2, process_group=mesh["replicate"]
    )
    opt.load_state_dict(saved["opt"])
    _steps(model, opt, rank // 2, 2, 1)
    return refused, untouched, (_full(model), _full_state(model, opt))


@multiprocess
@pytest.mark.parametrize("how", ["get_optimizer_state_dict", "full_tensor"])
def test_a_full_state_dict_saved_on_rank_0_is_refused_on_every_replica(how, tmp_path):
    results = run_world(_one_file_for_all, 4, str(tmp_path / "optim.pt"), how)
    straight = run_world(_trained, 4, 3)
    for rank, (message, untouched, resumed) in enumerate(results):
        assert message is not None, f"rank {rank} resumed from replica 0's state without a word"
        assert "replica 1 of 2 loaded the optimizer state saved by replica 0" in message
        assert "full_state_dict=True" in message and "f'ckpt/replica{replica}'" in message
        # (set_optimizer_state_dict with broadcast_from_rank0 copies into the state's tensors
        # itself before it calls load_state_dict: only the direct load can be kept clean)
        if how == "full_tensor":
            assert untouched, f"rank {rank}: the refused load changed the optimizer state"
        assert _equal(resumed, straight[rank]), f"rank {rank}: the per-rank resume is not exact"


# -- Lightning's ModelParallelStrategy ---------------------------------------------------------------


def _lightning_model_parallel(rank, world, out):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy
    from test_sharded import _batch, _model
    from torch.distributed.fsdp import fully_shard

    class Sharded(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net, self.steps = _model(), 0

        def configure_model(self):
            for block in (self.net[0], self.net[2], self.net[4], self.net):
                fully_shard(block, mesh=self.device_mesh["tensor_parallel"])

        def training_step(self, batch, index):
            self.steps += 1
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return decent_optim.DecentralizedAdamW(
                self.parameters(), lr=1e-2, process_group=self.device_mesh["data_parallel"]
            )

    x, y = _batch(0, 0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=2)
    module = Sharded()
    trainer = L.Trainer(
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2),
        accelerator="cpu", devices=4, max_steps=2, logger=False,
        callbacks=[ModelCheckpoint(dirpath=out, every_n_train_steps=1)],
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
    )  # fmt: skip
    try:
        trainer.fit(module, data)  # it trained, then died at the first checkpoint's DCP save
    except TypeError as err:
        return module.steps, str(err)
    return module.steps, None


@multiprocess
@needs_lightning
def test_lightning_model_parallel_strategy_is_refused_at_setup(tmp_path):
    for steps, message in run_world(_lightning_model_parallel, 4, str(tmp_path), timeout=300):
        assert message is not None, "trained under ModelParallelStrategy without a word"
        assert steps == 0, f"refused only after {steps} steps: {message}"
        assert "decent_optim.integrations.lightning.DecentralizedModelParallelStrategy" in message
        assert "ModelParallelStrategy with 2 replicas" in message, message
    written = [f for _, _, files in os.walk(tmp_path) for f in files]
    assert written == [], written


def test_the_guards_refusal_names_lightnings_strategy():
    # where a ModelParallelStrategy is not seen at setup (an optimizer built elsewhere), the
    # refusal of its first checkpoint names the strategy to use
    from unittest import mock

    from decent_optim.gossip.dcp_guard import ReplicaGuard

    guard = ReplicaGuard(1, 2, [2, 3])
    with mock.patch("torch.distributed.get_rank", return_value=3):  # no process group here
        with pytest.raises(ValueError, match="more than one replica") as caught:
            guard.check([0, 1, 2, 3])
    assert "DecentralizedModelParallelStrategy instead of ModelParallelStrategy" in str(
        caught.value
    )


def _lightning_fit(out, epochs, ckpt_path=None, **options):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from test_sharded import _batch, _model
    from torch.distributed.fsdp import fully_shard

    from decent_optim.integrations.lightning import DecentralizedModelParallelStrategy

    class Sharded(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net, self.losses = _model(), []

        def configure_model(self):
            for block in (self.net[0], self.net[2], self.net[4], self.net):
                fully_shard(block, mesh=self.device_mesh["tensor_parallel"])

        def training_step(self, batch, index):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return decent_optim.DecentralizedAdamW(
                self.parameters(), lr=1e-2, process_group=self.device_mesh["data_parallel"]
            )

    x, y = _batch(0, 0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=2)
    module = Sharded()
    strategy = DecentralizedModelParallelStrategy(
        data_parallel_size=2, tensor_parallel_size=2, **options
    )
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=4, max_epochs=epochs, logger=False,
        callbacks=[ModelCheckpoint(dirpath=out, save_top_k=-1, every_n_epochs=1)],
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
    )  # fmt: skip
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return module.losses, _full(module.net)


def _lightning_resume(rank, world, out):
    losses, params = _lightning_fit(out, 3)
    resumed_losses, resumed = _lightning_fit(out, 3, f"{out}/epoch=0-step=2.ckpt")
    return losses, params, resumed_losses, resumed, sorted(os.listdir(f"{out}/epoch=0-step=2.ckpt"))


@multiprocess
@needs_lightning
def test_lightning_decentralized_model_parallel_resumes_per_replica(tmp_path):
    results = run_world(_lightning_resume, 4, str(tmp_path), timeout=300)
    for losses, params, resumed_losses, resumed, folders in results:
        assert folders == ["replica0", "replica1"]
        assert len(losses) == 6 and resumed_losses == losses[2:]  # 2 steps per epoch
        assert _equal(resumed, params)
    assert results[0][0] != results[2][0]  # the replicas trained apart


def _lightning_resume_from_a_whole_file(rank, world, out):
    # save_distributed_checkpoint=False: ModelParallelStrategy's one file, rank 0's replica whole
    _lightning_fit(out, 1, save_distributed_checkpoint=False)
    try:
        _lightning_fit(out, 2, f"{out}/epoch=0-step=2.ckpt", save_distributed_checkpoint=False)
    except ValueError as err:
        return str(err)
    return None


@multiprocess
@needs_lightning
def test_lightning_resume_from_one_replicas_whole_file_is_refused(tmp_path):
    for message in run_world(_lightning_resume_from_a_whole_file, 4, str(tmp_path), timeout=300):
        assert message is not None, "replica 1 resumed from replica 0's state without a word"
        assert "replica 1 of 2 loaded the optimizer state saved by replica 0" in message
        assert "save_distributed_checkpoint=True (the default)" in message, message


def test_the_guard_outside_a_dcp_save_warns_and_still_plans_one_item():
    from decent_optim.gossip.dcp_guard import ReplicaGuard

    guard = ReplicaGuard(1, 2, [2, 3])
    with pytest.warns(UserWarning, match="cannot check that they belong to one replica"):
        (item,) = guard.__create_write_items__("optim.param_groups.0.decent_optim.replica", guard)
    assert item.type.name == "BYTE_IO" and item.index.offset is None
    guard.check([2, 3])  # the replica's own ranks: fine
    guard.check([])  # a save without torch.distributed (no_dist=True): fine
    assert copy.deepcopy(guard) is guard and int(guard) == 1

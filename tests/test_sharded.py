"""FSDP2 inside a replica, gossip across replicas (decent_optim.sharded), on gloo CPU ranks.

The reference is the same training unsharded: ``R x S`` ranks (replicas x shards) must end where
``R`` unsharded ranks with the same topology end, replica by replica, in float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_world

import decent_optim
from decent_optim import sharded

pytestmark = pytest.mark.multiprocess

OPTIMIZERS = {
    "DSGD": dict(lr=0.05, momentum=0.9, weight_decay=1e-2),
    "DecentralizedAdam": dict(lr=1e-2, weight_decay=1e-2),
    "DecentralizedAdamW": dict(lr=1e-2),
    "AccumAdam": dict(lr=1e-2, accum_iter=2),
    "AccumAdamW": dict(lr=1e-2, accum_iter=2),
}


def _model() -> torch.nn.Sequential:
    # 5, 3 and 1 output rows: over 2 or 4 shards some ranks hold uneven and 0-row shards
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(7, 5),
        torch.nn.Tanh(),
        torch.nn.Linear(5, 3),
        torch.nn.Tanh(),
        torch.nn.Linear(3, 1),
    ).double()


def _batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * replica + step)
    x = torch.randn(8, 7, generator=g, dtype=torch.float64)
    return x, torch.randn(8, 1, generator=g, dtype=torch.float64)


def _shard(model: torch.nn.Module, replicas: int, shards: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    return mesh


def _full(model: torch.nn.Module) -> list[torch.Tensor]:
    return [
        (p.full_tensor() if sharded.is_sharded(p) else p).detach().clone()
        for p in model.parameters()
    ]


def _train(rank, world, replicas, shards, name, topology, steps, options):
    """Train ``steps`` steps; returns (replica, full parameters, padding of every local shard)."""
    model = _model()
    if topology == "custom":  # arbitrary weights: point-to-point rounds
        topology = decent_optim.topologies.CustomTopology([[[0.7, 0.3], [0.3, 0.7]]])
    kwargs = dict(OPTIMIZERS[name], topology=topology, **options)
    if shards > 1:
        mesh = _shard(model, replicas, shards)
        kwargs["process_group"] = mesh["replicate"]
    opt = getattr(decent_optim, name)(model.parameters(), **kwargs)
    replica = rank // shards
    for step in range(steps):
        x, y = _batch(replica, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    # the unmixed values of the last step: after a pair's mix both replicas would be equal
    return replica, _full(model)


def _compare(replicas, shards, name, topology, steps=4, options=None, tol=1e-12):
    options = options or {}
    ref = run_world(_train, replicas, replicas, 1, name, topology, steps, options)
    got = run_world(_train, replicas * shards, replicas, shards, name, topology, steps, options)
    worst = 0.0
    for replica, params in got:
        for a, b in zip(params, ref[replica][1]):
            worst = max(worst, float((a - b).abs().max()))
    spread = max(float((a - b).abs().max()) for a, b in zip(ref[0][1], ref[1][1]))
    assert spread > 1e-4, "the replicas should differ: the test would prove nothing"
    print(f"max |sharded - unsharded| = {worst:.3g} (replicas differ by {spread:.3g})")
    assert worst <= tol, f"sharded run differs from the unsharded one by {worst}"
    return worst


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_2x2_equals_two_unsharded_replicas(name):
    _compare(2, 2, name, "ring")


@pytest.mark.parametrize(
    "replicas,shards,topology",
    [(4, 2, "ring"), (4, 2, "one-peer-exp"), (2, 4, "alternating-exp-ring")],
)
def test_eight_ranks(replicas, shards, topology):
    # local_world_size=1: one replica per node (the harness's LOCAL_WORLD_SIZE puts all on one)
    options = dict(local_world_size=1)
    _compare(replicas, shards, "DecentralizedAdamW", topology, steps=3, options=options)


@pytest.mark.parametrize("topology,options", [("custom", {}), ("ring", {"global_avg_every": 2})])
def test_custom_topology_and_global_averages(topology, options):
    _compare(2, 2, "DecentralizedAdam", topology, options=options)


@pytest.mark.parametrize(
    "outer", [None, decent_optim.LocalOuterSGD(every=4)], ids=["local_steps", "slow_outer"]
)
def test_local_steps_and_slow_outer_step_equal_unsharded_replicas(outer):
    # 9 steps: four rounds of 2 steps and two outer steps, on each shard's slice of the buffers
    options = dict(local_steps=2, outer=outer)
    _compare(2, 2, "DecentralizedAdamW", "ring", steps=9, options=options)


def _consensus_into_four_shards(rank, world, export):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model = _model()
    _shard(model, 1, 4)
    set_model_state_dict(model, export, options=StateDictOptions(full_state_dict=True))
    return _full(model)


def test_consensus_export_loads_into_another_shard_count():
    export = run_world(_around, 4, 2, 2)[0][5]
    for params in run_world(_consensus_into_four_shards, 4, export):
        assert all(torch.equal(p, export[k]) for p, k in zip(params, export))


@pytest.mark.parametrize(
    "compression, tol",
    [("int8", 5e-3), ("int4", 5e-3), ("top1%+int2", 2e-3), ("rand1%+int4", 5e-4)],
)
def test_compression_within_its_bound(compression, tol):
    # the sharded run quantises slices of 1024 values of its own buckets, the unsharded one
    # of its buckets: not the same bits, but each within the codec's error of the truth
    options = dict(compression=compression, local_world_size=1)
    _compare(2, 2, "DSGD", "ring", options=options, tol=tol)


def _padding(model: torch.nn.Module) -> list[float]:
    """Largest magnitude in FSDP2's padding of every local shard (beyond its own elements)."""
    out = []
    for p in model.parameters():
        shard = sharded.local(p)
        whole = torch.empty(0, dtype=shard.dtype).set_(shard.untyped_storage())
        out.append(
            float(whole[shard.numel() :].abs().max()) if whole.numel() > shard.numel() else 0.0
        )
    return out


def _start_and_padding(rank, world):
    torch.manual_seed(rank)  # every rank starts from other values: the broadcast must fix them
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rank)
    mesh = _shard(model, 2, 2)
    opt = decent_optim.DecentralizedAdamW(
        model.parameters(), lr=0.1, process_group=mesh["replicate"]
    )
    start = _full(model)
    shards = [tuple(sharded.local(p).shape) for p in model.parameters()]
    for step in range(3):
        x, y = _batch(rank // 2, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return start, shards, _padding(model), opt.topology.local_world_size


def test_replicas_start_equal_and_padding_stays_zero():
    results = run_world(_start_and_padding, 4)
    for start, _, padding, lws in results:
        for a, b in zip(start, results[0][0]):
            assert torch.equal(a, b)
        assert max(padding) == 0.0
        assert lws == 2  # LOCAL_WORLD_SIZE=4 ranks on one node hold 2 replicas
    assert (0, 3) in [s for r in results for s in r[1]], "some rank should hold a 0-row shard"


def _refusal(rank, world, case):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    kwargs = {"process_group": mesh["replicate"]}
    if case == "2-D mesh":
        fully_shard(model, mesh=mesh)
    elif case == "mixed":
        fully_shard(model[0], mesh=mesh["shard"])
    elif case == "shard index":
        # ranks (replica 0, shard 0) with (replica 1, shard 1): different slices
        groups = [dist.new_group([0, 3]), dist.new_group([1, 2])]
        fully_shard(model, mesh=mesh["shard"])
        kwargs = {"process_group": groups[0] if rank in (0, 3) else groups[1]}
    elif case == "overlap":
        fully_shard(model, mesh=mesh["shard"])
        kwargs = {}  # the world group: it holds the shard group
    elif case.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(
            model,
            process_group=mesh["shard"].get_group(),
            device_id=torch.device("cpu"),
            use_orig_params=case.endswith("orig"),
        )
    try:
        decent_optim.DecentralizedAdamW(model.parameters(), **kwargs)
    except Exception as err:
        return type(err).__name__, str(err)
    return None


@pytest.mark.parametrize(
    "case,words",
    [
        ("2-D mesh", 'mesh["shard"]'),
        ("mixed", "plain tensors"),
        ("shard index", "shard index"),
        ("overlap", "overlaps the mesh"),
        ("fsdp1", "FSDP2"),
        ("fsdp1 orig", "FSDP2"),
    ],
)
def test_refusals_reach_every_rank(case, words):
    results = run_world(_refusal, 4, case)
    assert all(r is not None for r in results), results
    assert all(words in r[1] for r in results), results[0]


def _build(replicas: int = 2, shards: int = 2):
    model = _model()
    mesh = _shard(model, replicas, shards)
    opt = decent_optim.DecentralizedAdamW(
        model.parameters(), lr=1e-2, process_group=mesh["replicate"]
    )
    return model, opt, mesh


def _steps(model, opt, replica: int, first: int, count: int) -> None:
    for step in range(first, first + count):
        x, y = _batch(replica, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _checkpoint(rank, world, how, path, phase):
    """``phase`` "save": 3 steps, save, 3 more; "resume": load, the same 3 more."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt, mesh = _build()
    replica = rank // 2
    shard_group = mesh["shard"].get_group()
    if phase == "save":
        _steps(model, opt, replica, 0, 3)
        if how == "torch.save":
            torch.save(
                {"model": model.state_dict(), "opt": opt.state_dict()}, f"{path}/rank{rank}.pt"
            )
        else:  # one checkpoint per replica, written by the ranks of that replica
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            dcp.save(state, checkpoint_id=f"{path}/replica{replica}", process_group=shard_group)
    else:
        if how == "torch.save":
            saved = torch.load(f"{path}/rank{rank}.pt", weights_only=False)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
        else:
            before = _full(model)
            msd, osd = get_state_dict(model, opt)
            # a fresh optimizer: DCP would call step() on it if its state were empty
            entry = opt.state_dict()["decent_optim"]  # the step counter, whether a round travels
            assert entry["step"] == 0 and not entry["pending"]
            assert all(torch.equal(a, b) for a, b in zip(before, _full(model)))
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=f"{path}/replica{replica}", process_group=shard_group)
            set_state_dict(
                model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
            assert opt.state_dict()["decent_optim"]["step"] == 3
    _steps(model, opt, replica, 3, 3)
    return _full(model)


@pytest.mark.parametrize("how", ["torch.save", "dcp"])
def test_resume_is_bit_exact(how, tmp_path):
    from _harness import run_world_fresh

    straight = run_world(_checkpoint, 4, how, str(tmp_path), "save")
    # a new set of processes: nothing survives but the files (as after a kill)
    resumed = run_world_fresh(_checkpoint, 4, how, str(tmp_path), "resume")
    for a, b in zip(straight, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def _around(rank, world, replicas, shards):
    """Gradient accumulation, clipping, then averaged(), consensus_distance() and export."""
    model = _model()
    kwargs: dict = {}
    if shards > 1:
        kwargs["process_group"] = _shard(model, replicas, shards)["replicate"]
    opt = decent_optim.DecentralizedAdamW(model.parameters(), lr=1e-2, **kwargs)
    replica, norms = rank // shards, []
    for step in range(3):
        for micro in range(2):
            if shards > 1:  # FSDP2 reduce-scatters the gradients of the last micro-batch only
                model.set_requires_gradient_sync(micro == 1)
            x, y = _batch(replica, 2 * step + micro)
            (torch.nn.functional.mse_loss(model(x), y) / 2).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        opt.step()
        opt.zero_grad()
    distance = opt.consensus_distance()
    x, _ = _batch(0, 0)
    with opt.averaged(model):
        averaged_out = model(x).detach()
    export = opt.consensus_state_dict(model)
    return replica, _full(model), norms, distance, averaged_out, export


def test_accumulation_clipping_averaged_distance_export():
    ref = run_world(_around, 2, 2, 1)
    got = run_world(_around, 4, 2, 2)
    for replica, params, norms, distance, out, export in got:
        r_params, r_norms, r_distance, r_out, r_export = ref[replica][1:]
        assert max(float((a - b).abs().max()) for a, b in zip(params, r_params)) <= 1e-12
        assert norms == pytest.approx(r_norms, rel=1e-12) and min(norms) > 0.05  # clipped
        assert distance == pytest.approx(r_distance, rel=1e-9) and distance > 0
        assert torch.allclose(out, r_out, rtol=0, atol=1e-12)
        assert export.keys() == r_export.keys()
        for k in export:  # whole tensors: they load into a plain model
            assert not sharded.is_sharded(export[k])
            assert torch.allclose(export[k], r_export[k], rtol=0, atol=1e-12)


def _mixed_precision_2x2(param_dtype):
    """A small model sharded 2 x 2 under FSDP2's MixedPrecisionPolicy (``param_dtype`` compute,
    fp32 parameters and reductions), its mesh and a DecentralizedAdamW over the replicas."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh["shard"], mp_policy=policy)
    opt = decent_optim.DecentralizedAdamW(
        model.parameters(), lr=1e-2, process_group=mesh["replicate"]
    )
    return model, mesh, opt


def _mixed_precision(rank, world):
    model, _, opt = _mixed_precision_2x2(torch.bfloat16)
    x, y = (t.float() for t in _batch(rank // 2, 0))
    losses = []
    for _ in range(5):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, {str(p.dtype) for p in model.parameters()}


def test_mixed_precision_policy_trains_fp32_params_in_bf16():
    for losses, dtypes in run_world(_mixed_precision, 4):
        assert dtypes == {"torch.float32"}
        assert losses[-1] < losses[0]  # the updated fp32 shards reach the bf16 all-gather


def _fp16_scaled(rank, world):
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    model, mesh, opt = _mixed_precision_2x2(torch.float16)
    # found_inf is agreed over the shard group, so every shard of a replica skips alike
    scaler = ShardedGradScaler("cpu", init_scale=2.0**20, process_group=mesh["shard"].get_group())
    for step in range(6):
        x, y = (t.float() for t in _batch(rank // 2, step))
        scaler.scale(torch.nn.functional.mse_loss(model(x).float(), y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return scaler.get_scale(), opt.state_dict()["decent_optim"]["step"], _full(model)


def test_fp16_with_sharded_grad_scaler():
    results = run_world(_fp16_scaled, 4)
    for scale, rounds, params in results:
        assert scale < 2.0**20  # overflowing steps were skipped ...
        assert rounds == 6  # ... and their gossip rounds still ran
        assert all(torch.isfinite(p).all() for p in params)
    assert not torch.equal(results[0][2][0], results[2][2][0])  # the replicas trained apart


def _compiled(rank, world, compiled):
    model = _model()
    mesh = _shard(model, 2, 2)
    if compiled:  # the FSDP2 blocks, as torchtitan compiles them (aot_eager: no C++ toolchain)
        for layer in model:
            if any(True for _ in layer.parameters()):
                layer.compile(backend="aot_eager")
    opt = decent_optim.DecentralizedAdamW(
        model.parameters(), lr=1e-2, process_group=mesh["replicate"]
    )
    _steps(model, opt, rank // 2, 0, 3)
    return _full(model)


def test_compiled_blocks_equal_eager():
    eager, compiled = run_world(_compiled, 4, False), run_world(_compiled, 4, True)
    for a, b in zip(eager, compiled):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def _consensus_dcp(rank, world, path, phase):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if phase == "save":  # 2 replicas x 2 shards; inside averaged() the replicas are equal
        model, opt, _ = _build()
        _steps(model, opt, rank // 2, 0, 3)
        with opt.averaged(model):
            dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)
            return _full(model)
    model = _model()  # 1 replica x 4 shards
    _shard(model, 1, 4)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    return _full(model)


def test_consensus_saved_with_dcp_over_all_ranks_loads_into_four_shards(tmp_path):
    saved = run_world(_consensus_dcp, 4, str(tmp_path), "save")
    loaded = run_world(_consensus_dcp, 4, str(tmp_path), "load")
    for a, b in zip(saved, loaded):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(x, y) for x, y in zip(saved[0], saved[2]))  # one model, not a mix

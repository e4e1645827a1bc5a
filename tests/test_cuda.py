"""The CUDA path, one check per code path that differs from the CPU's (issue 24).

Every test takes its device from one fixture, ``device``, set by the environment variable
``DECENT_OPTIM_TEST_DEVICE`` (default ``cuda``). Without a GPU the module is skipped, so CI stays
green; ``DECENT_OPTIM_TEST_DEVICE=cpu`` runs the same checks on the CPU, which is how the
module itself is kept correct on machines without one (the one-rank NCCL group is then a gloo
group: NCCL exchanges CUDA tensors only). On a GPU machine ``benchmarks/gpu_check.sh`` runs it
with the GPU benchmarks.

References are torch.optim's own optimizers (``fused=True``, or the single-tensor loop where
the question is the fused kernels themselves) stepped on copies with the same gradients.
``torch.compile`` uses inductor (Triton) on CUDA and ``aot_eager`` on the CPU (inductor's C++
compile would take minutes on CI's two cores); ``DECENT_OPTIM_TEST_COMPILE_BACKEND`` overrides.
"""

from __future__ import annotations

import copy
import math
import os
import warnings
from collections.abc import Callable

import pytest
import torch
from _harness import run_world
from torch import nn

import decent_optim as dopt

DEVICE_ENV = "DECENT_OPTIM_TEST_DEVICE"
DEVICE = torch.device(os.environ.get(DEVICE_ENV, "cuda"))
BACKEND = os.environ.get(
    "DECENT_OPTIM_TEST_COMPILE_BACKEND", "inductor" if DEVICE.type == "cuda" else "aot_eager"
)
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(),
    reason=f"torch.cuda.is_available() is False ({DEVICE_ENV}=cpu runs these checks on the CPU)",
)
# (class, kwargs, torch counterpart); accum_iter=1 makes AccumAdam(W) Adam(W)
CASES = [
    (dopt.DSGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01), torch.optim.SGD),
    (dopt.DSGD, dict(lr=0.05, momentum=0.9, nesterov=True, maximize=True), torch.optim.SGD),
    (dopt.DecentralizedAdam, dict(lr=0.01, weight_decay=0.1), torch.optim.Adam),
    (dopt.DecentralizedAdam, dict(lr=0.01, amsgrad=True, maximize=True), torch.optim.Adam),
    (dopt.DecentralizedAdamW, dict(lr=0.01, weight_decay=0.1), torch.optim.AdamW),
    (dopt.DecentralizedAdamW, dict(lr=0.01, amsgrad=True), torch.optim.AdamW),
    (dopt.AccumAdam, dict(lr=0.01, maximize=True, accum_iter=1), torch.optim.Adam),
    (dopt.AccumAdamW, dict(lr=0.01, weight_decay=0.1, accum_iter=1), torch.optim.AdamW),
]


def _case_id(case) -> str:
    cls, kwargs, _ = case
    return f"{cls.__name__}({','.join(f'{k}={v}' for k, v in kwargs.items())})"


@pytest.fixture(scope="module")
def device() -> torch.device:
    """The one device of this module (``DECENT_OPTIM_TEST_DEVICE``, default ``cuda``)."""
    return DEVICE


def _params(device: torch.device, precision: str) -> list[dict]:
    """Param groups: one float32 or bf16 group, or three groups of both dtypes (``mixed``)."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 33), (33,), (7, 5, 3), (1,)]
    dtypes = {
        "fp32": [torch.float32] * 4,
        "bf16": [torch.bfloat16] * 4,
        "mixed": [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16],
    }[precision]
    ps = [nn.Parameter(torch.randn(s, generator=gen).to(device, d)) for s, d in zip(shapes, dtypes)]
    if precision != "mixed":
        return [{"params": ps}]
    return [
        {"params": ps[:2]},
        {"params": [ps[2]], "lr": 0.003, "weight_decay": 0.2},
        {"params": [ps[3]], "lr": 0.02},
    ]


def _twin(groups: list[dict]) -> list[dict]:
    return [
        {**g, "params": [nn.Parameter(p.detach().clone()) for p in g["params"]]} for g in groups
    ]


def _flat(groups: list[dict]) -> list[torch.Tensor]:
    return [p for g in groups for p in g["params"]]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "mixed"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_world_size_one_equals_fused_torch_optim(case, precision, device):
    cls, kwargs, torch_cls = case
    mine = _params(device, precision)
    theirs = _twin(mine)
    a = cls(mine, **kwargs)
    torch_kwargs = {k: v for k, v in kwargs.items() if k != "accum_iter"}
    b = torch_cls(theirs, **torch_kwargs, fused=True)
    gen = torch.Generator().manual_seed(1)
    for t in range(50):
        for x, y in zip(_flat(mine), _flat(theirs)):
            x.grad = torch.randn(x.shape, generator=gen).to(device, x.dtype)
            y.grad = x.grad.clone()
        if t % 9 == 4:  # a parameter without a gradient is skipped, as torch skips it
            _flat(mine)[1].grad = _flat(theirs)[1].grad = None
        a.step()
        b.step()
        if t == 0:  # one step: the formula itself
            for x, y in zip(_flat(mine), _flat(theirs)):
                _assert_close(x, y)
    for x, y in zip(_flat(mine), _flat(theirs)):
        assert x.device.type == device.type and x.dtype == y.dtype
        _assert_close(x, y, steps=50)


def _assert_close(x: torch.Tensor, y: torch.Tensor, steps: int = 1) -> None:
    """torch's tolerance for the dtype; bf16 needs more, since two float32 formulas of the same
    step (ours compiled by inductor, torch's fused kernel) can round a value either way.

    After one step that happens on under 1% of the elements. Over many steps each such value
    feeds every later step (bf16 moments round too), so on an H100 AccumAdam's compiled kernel
    and torch's fused Adam differed in 3.0-3.5% of the elements after 50 steps, each by a few
    ulps: after several steps only the tolerance is checked. A wrong formula (bias correction,
    decay, sign) moves every element by about the learning rate and fails either check.
    """
    if x.dtype != torch.bfloat16:
        torch.testing.assert_close(x, y)
        return
    torch.testing.assert_close(x, y, rtol=2**-5, atol=2**-7)
    if steps == 1:
        differ = (x != y).float().mean().item()
        assert differ < 0.01, f"bf16 values differ in {differ:.1%} of places after one step"


def test_accum_adam_compiled_kernel_equals_its_eager_kernels(device):
    # fused=True compiles AccumAdam's one-pass update (Triton on CUDA); it must not fall back
    mine = _params(device, "fp32")
    theirs = _twin(mine)
    a = dopt.AccumAdamW(mine, lr=0.01, accum_iter=4, fused=True)
    b = dopt.AccumAdamW(theirs, lr=0.01, accum_iter=4, fused=False)
    gen = torch.Generator().manual_seed(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(10):
            for x, y in zip(_flat(mine), _flat(theirs)):
                x.grad = torch.randn(x.shape, generator=gen).to(device)
                y.grad = x.grad.clone()
            a.step()
            b.step()
    fell_back = [str(w.message) for w in caught if "could not compile" in str(w.message)]
    if device.type == "cuda":
        assert not fell_back, fell_back
    for x, y in zip(_flat(mine), _flat(theirs)):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_accum_adam_compiled_kernel_is_reused_under_a_learning_rate_schedule(device):
    # The scalars that change every step (rate, bias corrections) must not make dynamo
    # specialize: a kernel compiled per value hits the recompile limit after 8 steps and the
    # step falls back to eager kernels, several passes over memory, without a word.
    import torch._dynamo

    torch._dynamo.reset()
    params = _params(device, "fp32")
    opt = dopt.AccumAdamW(params, lr=0.01, weight_decay=0.1, accum_iter=2, fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1 / (1 + t))
    gen = torch.Generator().manual_seed(4)
    before, graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"], []
    for _ in range(12):
        for p in _flat(params):
            p.grad = torch.randn(p.shape, generator=gen).to(device)
        opt.step()
        schedule.step()
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - before)
    # one graph for a step inside a window, one for the step that ends it
    assert graphs[-1] == graphs[3] <= 2, graphs


# -- process groups --------------------------------------------------------------------------------


def _one_rank_group(rank, world_size, device_type):
    import torch.distributed as dist

    if device_type == "cuda":
        torch.cuda.set_device(0)
    # NCCL on a GPU; on the CPU the same logic over gloo (NCCL exchanges CUDA tensors only)
    group = dist.new_group([0], backend="nccl" if device_type == "cuda" else "gloo")
    results = {}
    for topology in ("complete", "ring", "one-peer-exp", "alternating-exp-ring"):
        for extra in ({}, {"global_avg_every": 2}):
            mine = _params(torch.device(device_type), "mixed")
            theirs = _twin(mine)
            a = dopt.DecentralizedAdamW(
                mine, lr=0.01, process_group=group, topology=topology, **extra
            )
            b = torch.optim.AdamW(theirs, lr=0.01, fused=True)
            for _ in range(5):
                for x, y in zip(_flat(mine), _flat(theirs)):
                    x.grad = torch.randn_like(x)
                    y.grad = x.grad.clone()
                a.step()
                b.step()
            a.synchronize()
            try:
                for x, y in zip(_flat(mine), _flat(theirs)):
                    _assert_close(x, y)
                results[f"{topology}{extra}"] = "equal"
            except AssertionError as err:
                results[f"{topology}{extra}"] = str(err)
    return results


@pytest.mark.multiprocess
def test_one_rank_nccl_group_with_every_topology(device):
    (results,) = run_world(_one_rank_group, 1, device.type, timeout=180)
    assert set(results.values()) == {"equal"}, results


def _two_processes_gloo(rank, world_size, device_type):
    import torch.distributed as dist

    t = torch.full((4,), float(rank + 1), device=device_type)
    dist.all_reduce(t)  # gloo all-reduces CUDA tensors (PyTorch's backend table)
    model = nn.Linear(4, 2).to(device_type)
    try:
        dopt.DecentralizedAdamW(model.parameters(), lr=0.01)
    except ValueError as err:
        return t.cpu(), str(err)
    return t.cpu(), "built"


@pytest.mark.multiprocess
def test_two_processes_on_one_device_over_gloo(device):
    """gloo all-reduces and broadcasts CUDA tensors but sends and receives CPU tensors only
    (torch.distributed's backend table), and a gossip round is made of sends and receives: the
    optimizers refuse CUDA parameters on a gloo group at construction, naming NCCL."""
    got = run_world(_two_processes_gloo, 2, device.type, timeout=120)
    for summed, built in got:
        assert torch.equal(summed, torch.full((4,), 3.0))
        if device.type == "cuda":
            assert "gloo backend sends CPU tensors only" in built and "NCCL" in built, built
        else:
            assert built == "built"


def _fsdp2_one_rank(rank, world_size, device_type):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if device_type == "cuda":
        torch.cuda.set_device(0)
    device = torch.device(device_type)
    # the groups of both mesh dimensions on NCCL (the harness's world group is gloo)
    backend = "nccl" if device_type == "cuda" else "gloo"
    mesh = init_device_mesh(
        device_type,
        (1, 1),
        mesh_dim_names=("replicate", "shard"),
        backend_override={"replicate": backend, "shard": backend},
    )
    model = _mlp(device)
    twin = copy.deepcopy(model)
    for block in (model[0], model[2], model):
        fully_shard(block, mesh=mesh["shard"])
    opt = dopt.DecentralizedAdamW(
        model.parameters(), lr=0.01, weight_decay=0.1, process_group=mesh["replicate"]
    )
    ref = torch.optim.AdamW(twin.parameters(), lr=0.01, weight_decay=0.1, fused=True)
    for t in range(5):
        x, y = _batch(device, t)
        for net, optimizer in ((model, opt), (twin, ref)):
            nn.functional.mse_loss(net(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    opt.synchronize()
    state = [opt.state[p]["exp_avg"] for p in model.parameters()]
    return (
        [p.full_tensor().detach().cpu() for p in model.parameters()],
        [p.detach().cpu() for p in twin.parameters()],
        {(type(s).__name__, s.device.type) for s in state},
    )


@pytest.mark.multiprocess
def test_fsdp2_at_world_size_one(device):
    """FSDP2 on the device (a 1 x 1 mesh, NCCL on a GPU): the bucket, the copy into FSDP2's
    sharded storage and its all-gather on the device; equal to fused AdamW on the plain model."""
    ((mine, theirs, state),) = run_world(_fsdp2_one_rank, 1, device.type, timeout=180)
    assert state == {("DTensor", device.type)}
    for x, y in zip(mine, theirs):
        _assert_close(x, y)


# -- mixed precision ----------------------------------------------------------------------------


def _mlp(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(device)


def _batch(device: torch.device, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + t)
    return torch.randn(8, 16, generator=gen).to(device), torch.randn(8, 4, generator=gen).to(device)


SCALED = [
    (dopt.DSGD, dict(lr=0.05, momentum=0.9), torch.optim.SGD),
    (dopt.DecentralizedAdamW, dict(lr=0.01), torch.optim.AdamW),
    (dopt.AccumAdamW, dict(lr=0.01, accum_iter=1), torch.optim.AdamW),
]


@pytest.mark.parametrize("case", SCALED, ids=_case_id)
def test_fp16_autocast_and_grad_scaler_skip_the_step_that_found_inf(case, device):
    cls, kwargs, torch_cls = case
    models = [_mlp(device), _mlp(device)]
    a = cls(models[0].parameters(), **kwargs)
    b = torch_cls(
        models[1].parameters(), **{k: v for k, v in kwargs.items() if k != "accum_iter"}, fused=True
    )
    scalers = [torch.amp.GradScaler(device.type, init_scale=2.0**10) for _ in models]
    for t in range(12):
        x, y = _batch(device, t)
        # Both take the gradients of the first model's fp16 forward (the scalers' scales stay
        # equal, checked below). Each model's own forward would turn the last-bit differences
        # of two float32 update formulas into fp16 rounding of its activations (2e-5 apart
        # after 12 steps on an H100), which says nothing about the scaler.
        a.zero_grad()
        with torch.autocast(device.type, dtype=torch.float16):
            loss = nn.functional.mse_loss(models[0](x).float(), y)
        scalers[0].scale(loss).backward()
        scalers[1].scale(loss)
        if t == 4:
            models[0][0].weight.grad[0, 0] = math.inf
        for mine, theirs in zip(models[0].parameters(), models[1].parameters()):
            theirs.grad = mine.grad.clone()
        for opt, scaler in zip((a, b), scalers):
            scaler.step(opt)
            scaler.update()
    assert scalers[0].get_scale() == scalers[1].get_scale() < 2.0**10
    for x, y in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(x, y)


# -- torch.compile ------------------------------------------------------------------------------


def _train(device, compile_model: bool, compile_step: bool, steps: int = 10):
    import torch._dynamo

    torch._dynamo.reset()
    model = _mlp(device)
    opt = dopt.DecentralizedAdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    forward = torch.compile(model, backend=BACKEND) if compile_model else model
    step = torch.compile(opt.step, backend=BACKEND) if compile_step else opt.step
    warm = None
    for t in range(steps):
        x, y = _batch(device, t)
        opt.zero_grad()
        nn.functional.mse_loss(forward(x), y).backward()
        step()
        if t == 2:
            warm = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return [p.detach().clone() for p in model.parameters()], warm, graphs


@pytest.mark.parametrize("what", ["model", "opt.step"])
def test_compiled_equals_eager_without_recompiles_after_step_3(what, device):
    want, _, _ = _train(device, False, False)
    got, warm, graphs = _train(device, what == "model", what == "opt.step")
    assert warm >= 1, "nothing was compiled"
    assert graphs == warm, f"recompiled after step 3: {warm} -> {graphs} graphs"
    for x, y in zip(got, want):
        # generated kernels may round differently; a skipped or doubled update moves by ~lr
        torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-4)


# -- gradients laid out unlike their parameters -------------------------------------------------


def _strided(device: torch.device) -> list[tuple[torch.Tensor, Callable]]:
    """(parameter, a function laying gradient values out with other strides than it) pairs."""
    gen = torch.Generator().manual_seed(5)

    def r(*s):
        return torch.randn(s, generator=gen).to(device)

    def every_other(g):
        holder = torch.zeros(2 * g.numel(), device=g.device, dtype=g.dtype)
        holder[::2].copy_(g)
        return holder[::2]

    cl = torch.channels_last
    return [
        (r(8, 3, 3, 3), lambda g: g.contiguous(memory_format=cl)),
        (r(8, 3, 3, 3).contiguous(memory_format=cl), lambda g: g.contiguous()),
        (r(6, 4), lambda g: g.t().contiguous().t()),  # a transposed view
        (r(5), every_other),
    ]


@pytest.mark.parametrize("case", [CASES[0], CASES[4], CASES[7]], ids=_case_id)
def test_gradients_with_other_strides_than_their_parameters(case, device):
    cls, kwargs, torch_cls = case
    pairs = _strided(device)
    mine = [nn.Parameter(p.clone()) for p, _ in pairs]  # clone keeps the memory format
    theirs = [nn.Parameter(p.clone()) for p, _ in pairs]
    a = cls(mine, **kwargs)
    # the single-tensor loop: the reference must not share the question of the fused kernels
    torch_kwargs = {k: v for k, v in kwargs.items() if k != "accum_iter"}
    b = torch_cls(theirs, **torch_kwargs, foreach=False)
    gen = torch.Generator().manual_seed(6)
    for _ in range(5):
        for x, y, (_, layout) in zip(mine, theirs, pairs):
            g = torch.randn(x.shape, generator=gen).to(device)
            x.grad, y.grad = layout(g), g
            assert x.grad.stride() != x.stride() and torch.equal(x.grad, g)
        a.step()
        b.step()
    for x, y in zip(mine, theirs):
        torch.testing.assert_close(x, y)


# -- moving the model after the optimizer was built -----------------------------------------------


def test_model_to_the_same_device_is_taken_back(device):
    def run(move: bool):
        model = _mlp(device)
        opt = dopt.DecentralizedAdamW(model.parameters(), lr=0.01)
        for t in range(6):
            if move and t == 3:
                model.to(device.type)  # "cuda" or "cpu": no index
                model.to(torch.device(device.type, 0))
            x, y = _batch(device, t)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        assert all(p.untyped_storage().nbytes() == p.nbytes for p in model.parameters())
        return [p.detach().clone() for p in model.parameters()]

    for x, y in zip(run(True), run(False)):
        assert torch.equal(x, y)


def test_model_moved_to_the_gpu_after_the_optimizer_says_what_to_do(device):
    if device.type != "cuda":
        pytest.skip(f"needs a second device kind ({DEVICE_ENV}={device.type})")
    model = _mlp(torch.device("cpu"))
    opt = dopt.DecentralizedAdamW(model.parameters(), lr=0.01)
    model.to(device)
    x, y = _batch(device, 0)
    nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(RuntimeError, match="the model was moved"):
        opt.step()


# -- saving ---------------------------------------------------------------------------------------


def test_torch_save_and_safetensors_round_trip(device, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model = _mlp(device)
    opt = dopt.DecentralizedAdamW(model.parameters(), lr=0.01)
    plain = copy.deepcopy(model)

    def train(m, o, ts):
        for t in ts:
            x, y = _batch(device, t)
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()

    train(model, opt, range(3))
    plain.load_state_dict(model.state_dict())
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    torch.save(plain.state_dict(), tmp_path / "plain.pt")
    safetensors_torch.save_model(model, str(tmp_path / "model.safetensors"))
    safetensors_torch.save_model(plain, str(tmp_path / "plain.safetensors"))
    for name in ("safetensors",):  # the optimizer's buckets add no bytes to the model's file
        assert (tmp_path / f"model.{name}").stat().st_size == (
            tmp_path / f"plain.{name}"
        ).stat().st_size
    train(model, opt, range(3, 6))  # the uninterrupted run

    resumed = _mlp(device)
    again = dopt.DecentralizedAdamW(resumed.parameters(), lr=0.01)
    ckpt = torch.load(tmp_path / "ckpt.pt", map_location=device)
    resumed.load_state_dict(ckpt["model"])
    again.load_state_dict(ckpt["opt"])
    train(resumed, again, range(3, 6))
    for x, y in zip(resumed.parameters(), model.parameters()):
        assert torch.equal(x, y)

    fresh = _mlp(device)
    missing, unexpected = safetensors_torch.load_model(fresh, str(tmp_path / "model.safetensors"))
    assert not missing and not unexpected
    for x, y in zip(fresh.parameters(), plain.parameters()):
        assert x.device.type == device.type and torch.equal(x, y)

"""The CUDA path of what came after the first GPU check: the gossip codecs, local steps, the outer
step on slow weights, ``uneven=True``, and a checkpoint of them saved on the GPU.

One GPU holds one rank (NCCL refuses two ranks on one device, and gloo does not send CUDA
tensors: ``tests/test_cuda.py``), so what is checked here is what a rank does on its own device:
a codec's encode and decode, and the schedule of rounds at world size one (an NCCL group of one
rank). Same conventions as ``tests/test_cuda.py``: the device comes from
``DECENT_OPTIM_TEST_DEVICE`` (default ``cuda``, skipped without one; ``cpu`` runs the checks
here), ``benchmarks/gpu_check.sh`` runs the module on a GPU.

References: the codecs' numpy reference written from their documented format
(``tests/test_codecs_sparse.py``); torch.optim's fused AdamW inside and torch's SGD with Nesterov
momentum outside for the schedules (a worker alone: its round mixes nothing).
"""

from __future__ import annotations

import io

import pytest
import torch
from _harness import run_world
from test_codecs_sparse import LEVELS, reference
from test_cuda import DEVICE, _batch, _mlp
from test_cuda import pytestmark as pytestmark  # the same skip without a GPU
from torch import nn

import decent_optim as dopt
from decent_optim.gossip import codecs
from decent_optim.gossip.codec_base import CHUNK, slice_len
from decent_optim.runtime import wire

# -- the codecs on the device ---------------------------------------------------------------------


def _spec(name: str) -> tuple[str, float, int | None]:
    """(keep, percent, bits) of a codec name, as the numpy reference takes them."""
    if name == "int8":
        return "all", 100.0, 8
    spec = wire.parse(name)
    assert spec is not None
    return spec.keep, spec.percent, None if spec.bits == 32 else spec.bits


@pytest.mark.parametrize(
    "name", ["bf16", "int8", "int4", "int2", "rand1%", "top1%", "rand1%+int4", "top10%+int8"]
)
def test_a_codec_on_the_device_adds_what_the_reference_adds(name):
    """Encode (with the sender's absorb) and decode on the device, against the numpy reference.

    Over two slices of the device's pass, and a partial chunk at the end. A quotient that lands
    on a rounding boundary may round the other way on a GPU (its reciprocal and product are not
    numpy's), so a quantized value may differ by one level there: allowed on one value in a
    thousand. A wrong scale, packing, position or slice moves whole chunks.
    """
    n = slice_len(DEVICE) + 3 * CHUNK + 17
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(n, generator=gen)
    b = a + torch.randn(n, generator=gen) * 1e-2
    b[:5] = a[:5]  # a run of exact zeros
    codec = codecs.get(name)
    payload = torch.empty(codec.nbytes(n), dtype=torch.uint8, device=DEVICE)
    mine = b.to(DEVICE, copy=True)  # absorb adds into it
    codec.encode_(a.to(DEVICE), mine, payload, absorb=True, seed=11)
    got = torch.zeros(n, device=DEVICE)
    codec.decode_add_(payload, got)
    assert not bool(codec.nonfinite(payload))
    # the sender's copy took exactly what a holder adds, on the device as on the CPU
    torch.testing.assert_close(mine, b.to(DEVICE) + got, rtol=0, atol=0)
    got = got.cpu()
    if name == "bf16":
        want = (a - b).to(torch.bfloat16).float()
        assert torch.equal(got, want)
        return
    keep, percent, bits = _spec(name)
    want = reference(keep, percent, bits, CHUNK, a, b, 11)
    if keep == "top":  # distinct magnitudes here (random data): the positions are the rule's
        assert torch.equal(got != 0, want != 0)
    step = 0.0 if bits is None else float((a - b).abs().max()) / LEVELS[bits]
    off = (got - want).abs()
    assert float(off.max()) <= 1.001 * step, f"largest difference {float(off.max())}"
    assert int((off > 0).sum()) <= n // 1000, f"{int((off > 0).sum())} values differ"
    assert got.count_nonzero() > 0


# -- local steps, the outer step and uneven rounds at world size one ------------------------------


def _loss(model: nn.Module, t: int) -> torch.Tensor:
    x, y = _batch(next(model.parameters()).device, t)
    return nn.functional.mse_loss(model(x), y)


#: name -> (options, the steps after which the outer step comes, outer lr, outer momentum)
SLOW = dict(outer=dopt.LocalOuterSGD(lr=0.5, momentum=0.7, every=4))
SCHEDULES = {
    "local3-diloco": (dict(local_steps=3, outer="diloco"), (3, 6, 9), 0.7, 0.9),
    "local2-slow4": (dict(local_steps=2, **SLOW), (4, 8), 0.5, 0.7),
    "local2-slow4-int8": (dict(local_steps=2, compression="int8", **SLOW), (4, 8), 0.5, 0.7),
    "local4-top1%+int2": (dict(local_steps=4, compression="top1%+int2"), (), 0.0, 0.0),
    "uneven": (dict(uneven=True), (), 0.0, 0.0),
    # uneven_outer's rule: round k launches after step 2k and is mixed 2 steps later, and the
    # outer step follows the update of the step that mixes a round whose launch count crossed a
    # multiple of 4 (round 2: step 6; round 4: step 10), or at once when synchronize() mixes it
    # (the save after step 5 does so for round 2; then round 3 launches after step 6, round 4
    # after step 8 and is mixed at step 10)
    "uneven-local2-slow4": (dict(uneven=True, local_steps=2, **SLOW), (5, 10), 0.5, 0.7),
}


def _group(device_type: str):
    import torch.distributed as dist

    if device_type == "cuda":
        torch.cuda.set_device(0)
    # NCCL on a GPU; on the CPU the same logic over gloo (NCCL exchanges CUDA tensors only)
    return dist.new_group([0], backend="nccl" if device_type == "cuda" else "gloo")


def _reference(device: torch.device, steps: int, outer_after, lr: float, momentum: float):
    """torch's fused AdamW; after the steps ``outer_after`` torch's SGD (Nesterov) on the slow
    weights, whose gradient is slow - fast, and the fast weights restart from them."""
    model = _mlp(device)
    inner = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    slow = [p.detach().clone().requires_grad_() for p in model.parameters()]
    outer = torch.optim.SGD(slow, lr=lr or 1.0, momentum=momentum, nesterov=momentum > 0)
    for t in range(steps):
        inner.zero_grad()
        _loss(model, t).backward()
        inner.step()
        if t + 1 in outer_after:
            with torch.no_grad():
                for s, p in zip(slow, model.parameters()):
                    s.grad = s - p
                outer.step()
                for s, p in zip(slow, model.parameters()):
                    p.copy_(s)
    return model


def _train(model, opt, ts, uneven: bool) -> None:
    if uneven:  # a budget beyond the run: one rank alone never waits
        opt.stop_at(1000)
    for t in ts:
        opt.zero_grad()
        _loss(model, t).backward()
        opt.step()


def _schedule_on_one_rank(rank, world_size, device_type, name):
    """Trains 10 steps, saved after 5 (on the device, loaded mapped to the CPU) and resumed."""
    device = torch.device(device_type)
    group = _group(device_type)
    options, outer_after, lr, momentum = SCHEDULES[name]
    uneven = bool(options.get("uneven"))
    model = _mlp(device)
    opt = dopt.DecentralizedAdamW(model.parameters(), lr=0.01, process_group=group, **options)
    _train(model, opt, range(5), uneven)
    opt.synchronize()
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, saved)
    _train(model, opt, range(5, 10), uneven)
    opt.synchronize()

    saved.seek(0)
    ckpt = torch.load(saved, map_location="cpu")  # a checkpoint read on a machine without a GPU
    resumed = _mlp(device)
    resumed.load_state_dict(ckpt["model"])
    again = dopt.DecentralizedAdamW(resumed.parameters(), lr=0.01, process_group=group, **options)
    again.load_state_dict(ckpt["opt"])
    _train(resumed, again, range(5, 10), uneven)
    again.synchronize()
    state_devices = {
        v.device.type for s in again.state.values() for v in s.values() if torch.is_tensor(v)
    }
    want = _reference(device, 10, outer_after, lr, momentum)
    return (
        [p.detach().cpu() for p in model.parameters()],
        [p.detach().cpu() for p in resumed.parameters()],
        [p.detach().cpu() for p in want.parameters()],
        {p.device.type for p in model.parameters()},
        state_devices,
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_a_schedule_alone_on_the_device_is_torch_adamw_and_sgd_and_resumes(name):
    """A worker alone: its rounds mix nothing (compressed or not), so local steps are AdamW's
    steps and the outer step is torch's SGD on the slow weights; a checkpoint saved on the
    device and read mapped to the CPU resumes on the device, bit for bit."""
    ((run, resumed, want, param_devices, state_devices),) = run_world(
        _schedule_on_one_rank, 1, DEVICE.type, name, timeout=180
    )
    assert param_devices == {DEVICE.type} and state_devices <= {DEVICE.type}, state_devices
    for x, y in zip(run, resumed):
        assert torch.equal(x, y)
    for x, y in zip(run, want):
        torch.testing.assert_close(x, y)
    if SCHEDULES[name][1]:  # the outer step moved the weights off AdamW's path
        plain = _reference(torch.device("cpu"), 10, (), 0.0, 0.0)
        assert not torch.allclose(run[0], next(plain.parameters()).detach(), atol=1e-4)

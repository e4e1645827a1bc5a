"""Parameters that leave their bucket are taken back at the next step, and wrappers are seen through.

``model.to("cpu:0")`` (accelerate, HF Trainer), ``p.data = t`` (torch's ``average_parameters``)
give a parameter new memory after the optimizer was built. The next step (or any method that reads
the buckets) waits for the round in flight, copies the new values into the bucket and aliases it
again: training goes on as if the values had been written in place at that moment.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from _harness import run_world
from torch import nn

import decent_optim as dopt

OPTIMIZERS = [
    (dopt.DSGD, dict(lr=0.05, momentum=0.9)),
    (dopt.DecentralizedAdam, dict(lr=0.01)),
    (dopt.DecentralizedAdamW, dict(lr=0.01, weight_decay=0.1)),
    (dopt.AccumAdam, dict(lr=0.01, accum_iter=2)),
    (dopt.AccumAdamW, dict(lr=0.01, accum_iter=2)),
]
STEPS, AT = 7, 3


def _new_values(p: torch.Tensor, rank: int) -> torch.Tensor:
    return p.detach() * 0.5 + 0.25 * (rank + 1)


def _none(model, opt, rank):
    pass


def _move(model, opt, rank):
    model.to("cpu:0")  # an equal device: torch copies every parameter


def _reassign(model, opt, rank):
    for p in model.parameters():
        p.data = _new_values(p, rank)


def _write_in_place(model, opt, rank):
    # the same values written into the buckets, once the round in flight is complete
    # (consensus_distance waits for its transfers and leaves its mix to the next step)
    opt.consensus_distance()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(_new_values(p, rank))


EVENTS = {"none": _none, "move": _move, "reassign": _reassign, "in-place": _write_in_place}


def _run(rank: int, cls, kw: dict, event, where: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = cls(model.parameters(), **kw)
    gen = torch.Generator().manual_seed(10 + rank)
    for t in range(STEPS):
        if t == AT and where == "before-forward":
            event(model, opt, rank)
        opt.zero_grad()
        model(torch.randn(16, 4, generator=gen)).square().mean().backward()
        if t == AT and where == "before-step":
            event(model, opt, rank)
        opt.step()
    opt.synchronize()
    # still in the buckets: each parameter's storage holds that parameter alone
    assert all(p.untyped_storage().nbytes() == p.nbytes for p in model.parameters())
    return [p.detach().clone() for p in model.parameters()]


def _all_events(rank: int, world_size: int) -> dict[str, list[torch.Tensor]]:
    out = {}
    for cls, kw in OPTIMIZERS:
        for where in ("before-forward", "before-step"):
            for name, event in EVENTS.items():
                out[f"{cls.__name__}/{where}/{name}"] = _run(rank, cls, kw, event, where)
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [1, 2])
def test_moved_or_reassigned_parameters_are_taken_back_with_their_values(world_size):
    results = run_world(_all_events, world_size)
    for runs in results:
        for cls, _ in OPTIMIZERS:
            for where in ("before-forward", "before-step"):
                run = {name: runs[f"{cls.__name__}/{where}/{name}"] for name in EVENTS}
                label = f"{cls.__name__} {where}"
                # .to("cpu:0") changes nothing: the run equals the uninterrupted one
                for a, b in zip(run["move"], run["none"]):
                    assert torch.equal(a, b), label
                # p.data = t: as if t had been written in place after the round in flight
                for a, b in zip(run["reassign"], run["in-place"]):
                    assert torch.equal(a, b), label
                assert not all(torch.equal(a, b) for a, b in zip(run["reassign"], run["none"]))


def _post_local_sgd(rank: int, world_size: int) -> list[torch.Tensor]:
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    inner = dopt.DSGD(model.parameters(), lr=0.1)
    # average_parameters sets every p.data to a view of its own flat tensor
    opt = PostLocalSGDOptimizer(inner, PeriodicModelAverager(period=2, warmup_steps=2))
    assert dopt.unwrap(opt) is inner
    gen = torch.Generator().manual_seed(rank)
    for _ in range(6):
        opt.zero_grad()
        model(torch.randn(8, 4, generator=gen)).square().mean().backward()
        opt.step()
    dopt.unwrap(opt).synchronize()
    assert all(p.untyped_storage().nbytes() == p.nbytes for p in model.parameters())
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.multiprocess
def test_post_local_sgd_around_a_decentralized_optimizer_trains():
    a, b = run_world(_post_local_sgd, 2)
    assert all(torch.isfinite(p).all() for p in a + b)


# -- unwrap ---------------------------------------------------------------------------------------


def test_unwrap_returns_our_optimizer_and_refuses_others():
    p = nn.Parameter(torch.zeros(2))
    opt = dopt.DSGD([p], lr=0.1)
    assert dopt.unwrap(opt) is opt
    with pytest.raises(TypeError, match="unwrap expects a decent_optim optimizer.*got a SGD"):
        dopt.unwrap(torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1))

    class Wrapper:  # a wrapper around torch.optim: names what it holds
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def step(self):
            self.optimizer.step()

    with pytest.raises(TypeError, match=r"got a Wrapper \(it holds a SGD\)"):
        dopt.unwrap(Wrapper(torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)))
    assert dopt.unwrap(Wrapper(Wrapper(opt))) is opt


def _framework_wrappers(rank: int, world_size: int, frameworks: list[str]) -> list[str]:
    checked = []
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = dopt.DecentralizedAdamW(model.parameters(), lr=0.1)
    if "accelerate" in frameworks:
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState

        accelerator = Accelerator(cpu=True)
        try:
            prepared = accelerator.prepare(opt)
            assert type(prepared).__name__ == "AcceleratedOptimizer"
            assert not hasattr(prepared, "averaged")  # accelerate forwards no attributes
            model(torch.ones(2, 3)).sum().backward()
            prepared.step()
            assert dopt.unwrap(prepared) is opt
            with dopt.unwrap(prepared).averaged(model):
                pass
            checked.append("accelerate")
        finally:
            accelerator.free_memory()
            AcceleratorState._reset_state(reset_partial_state=True)
    if "lightning" in frameworks:
        from lightning.pytorch.core.optimizer import LightningOptimizer

        wrapped = LightningOptimizer(opt)
        assert isinstance(wrapped, dopt.DecentralizedAdamW)  # Lightning imitates the class
        assert dopt.unwrap(wrapped) is opt  # but the wrapped object is the one with the state
        dopt.unwrap(wrapped).synchronize()
        checked.append("lightning")
    return checked


@pytest.mark.multiprocess
@pytest.mark.parametrize("framework", ["accelerate", "lightning"])
def test_unwrap_sees_through_framework_wrappers(framework):
    if importlib.util.find_spec(framework) is None:
        pytest.skip(f"{framework} is not installed")
    assert run_world(_framework_wrappers, 1, [framework]) == [[framework]]

"""Parameters that leave their bucket are taken back at the next step, and wrappers are seen through.

``model.to("cpu:0")`` (accelerate, HF Trainer), ``p.data = t`` (torch's ``average_parameters``)
give a parameter new memory after the optimizer was built. The next step (or any method that reads
the buckets) takes them back into the bucket and aliases it again. A move (the same values) leaves
the round in flight to be mixed as usual; new values settle the round first, so training goes on
as if ``opt.synchronize()`` had been called just before they were written in place (as
torch.optim, the next step updates exactly the new values; mixing them with the neighbours'
values of the round before would halve the change).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from _harness import run_world
from _optimizers import EVERY_OPTIMIZER
from torch import nn

import decent_optim as dopt

OPTIMIZERS = EVERY_OPTIMIZER
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
    # the same values written into the buckets the documented way: synchronize() first
    new = [_new_values(p, rank) for p in model.parameters()]
    opt.synchronize()
    with torch.no_grad():
        for p, value in zip(model.parameters(), new):
            p.copy_(value)


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
                # p.data = t: as if t had been written in place after synchronize()
                for a, b in zip(run["reassign"], run["in-place"]):
                    assert torch.equal(a, b), label
                assert not all(torch.equal(a, b) for a, b in zip(run["reassign"], run["none"]))


def _post_local_sgd(rank: int, world_size: int, by_hand: bool) -> list[torch.Tensor]:
    import torch.distributed as dist
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    inner = dopt.DSGD(model.parameters(), lr=0.1, momentum=0.5)
    # average_parameters sets every p.data to a slice of one new flat tensor
    opt = PostLocalSGDOptimizer(inner, PeriodicModelAverager(period=2, warmup_steps=2))
    assert dopt.unwrap(opt) is inner
    gen = torch.Generator().manual_seed(rank)
    for t in range(7):
        opt.zero_grad()
        model(torch.randn(8, 4, generator=gen)).square().mean().backward()
        if not by_hand:
            opt.step()
            continue
        # the same averaging written in place, after synchronize() as the docs ask
        inner.step()
        if t >= 2 and (t - 2) % 2 == 0:
            means = [p.detach() / world_size for p in model.parameters()]
            for mean in means:
                dist.all_reduce(mean)
            inner.synchronize()
            with torch.no_grad():
                for p, mean in zip(model.parameters(), means):
                    p.copy_(mean)
    inner.synchronize()
    assert all(p.untyped_storage().nbytes() == p.nbytes for p in model.parameters())
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.multiprocess
def test_post_local_sgd_around_a_decentralized_optimizer_equals_averaging_in_place():
    wrapped = run_world(_post_local_sgd, 2, False)
    by_hand = run_world(_post_local_sgd, 2, True)
    for got, want in zip(wrapped, by_hand):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


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

    class LightningLike(type(opt)):  # Lightning's way: an instance of the class it wraps
        def __init__(self, optimizer):
            self.__dict__ = dict(optimizer.__dict__)
            self._optimizer = optimizer

    assert isinstance(LightningLike(opt), dopt.DSGD)
    assert dopt.unwrap(LightningLike(opt)) is opt
    assert dopt.unwrap(Wrapper(LightningLike(opt))) is opt


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

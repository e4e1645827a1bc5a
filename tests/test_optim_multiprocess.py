"""Every optimizer x every built-in topology on gloo ranks, against the dense reference.

Each rank trains the same small network on its own data stream; the reference stacks the ranks'
flattened parameters as rows and applies ``W(t)`` and the textbook update step by step
(``tests/reference.py``). Gradients in the reference come from the same network and data,
recomputed per row with autograd.
"""

from __future__ import annotations

import pytest
import torch
from _harness import run_world
from reference import Segment, simulate, worker_gradients
from torch import nn

import decent_optim as dopt
from decent_optim.topologies import get as get_topology

STEPS = 30

# (optimizer, kwargs, reference kind, reference hyper-parameters of group 0, of group 1)
# group 1 (the second layer) overrides lr and weight_decay, to exercise per-group values.
OPTIMIZERS = {
    "DSGD": (
        dopt.DSGD,
        dict(lr=0.05, momentum=0.9, weight_decay=1e-3),
        "sgd",
        dict(lr=0.05, momentum=0.9, weight_decay=1e-3),
    ),
    "DSGD-nesterov": (
        dopt.DSGD,
        dict(lr=0.05, momentum=0.5, nesterov=True),
        "sgd",
        dict(lr=0.05, momentum=0.5, nesterov=True),
    ),
    "DecentralizedAdam": (
        dopt.DecentralizedAdam,
        dict(lr=0.01, weight_decay=1e-2),
        "adam",
        dict(lr=0.01, weight_decay=1e-2),
    ),
    "DecentralizedAdamW": (
        dopt.DecentralizedAdamW,
        dict(lr=0.01, betas=(0.8, 0.95), weight_decay=0.1),
        "adam",
        dict(lr=0.01, betas=(0.8, 0.95), weight_decay=0.1, decoupled=True),
    ),
    "AccumAdam": (
        dopt.AccumAdam,
        dict(lr=0.01, weight_decay=1e-2, accum_iter=3),
        "accum_adam",
        dict(lr=0.01, weight_decay=1e-2, accum_iter=3),
    ),
    "AccumAdamW": (
        dopt.AccumAdamW,
        dict(lr=0.01, weight_decay=0.1),
        "accum_adam",
        dict(lr=0.01, weight_decay=0.1, accum_iter=4, decoupled=True),
    ),
}
GROUP1 = dict(lr=0.02, weight_decay=0.05)

# (topology, world size, local world size): every size the topology allows among 2, 3, 4, 8
TOPOLOGIES = [
    ("complete", 2, 1),
    ("complete", 3, 1),
    ("complete", 4, 1),
    ("complete", 8, 1),
    ("ring", 2, 1),
    ("ring", 3, 1),
    ("ring", 4, 1),
    ("ring", 8, 1),
    ("one-peer-exp", 2, 1),
    ("one-peer-exp", 4, 1),
    ("one-peer-exp", 8, 1),
    ("alternating-exp-ring", 2, 1),
    ("alternating-exp-ring", 4, 2),
    ("alternating-exp-ring", 8, 2),
    ("alternating-exp-ring", 8, 4),
]


def _model() -> nn.Module:
    torch.manual_seed(1234)  # the same start on every rank and in the reference
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()


def _batch(rank: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s data at step ``t``: different on every rank and step."""
    gen = torch.Generator().manual_seed(1000 * rank + t)
    x = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    y = torch.randn(4, 2, generator=gen, dtype=torch.float64) + rank
    return x, y


def _loss(model: nn.Module, rank: int, t: int) -> torch.Tensor:
    x, y = _batch(rank, t)
    return ((model(x) - y) ** 2).mean()


def _param_groups(model: nn.Module) -> list[dict]:
    return [{"params": model[0].parameters()}, {"params": model[2].parameters(), **GROUP1}]


def _train(rank, world_size, name, topology, local, steps, skip_rank_step):
    cls, kwargs, *_ = OPTIMIZERS[name]
    model = _model()
    # a tiny bucket cap, so the run uses several buckets per group
    opt = cls(
        _param_groups(model),
        **kwargs,
        topology=topology,
        local_world_size=local,
        bucket_cap_mb=64 / 2**20,
    )
    for t in range(steps):
        opt.zero_grad()
        if (rank, t) != skip_rank_step:  # this rank has no gradient: its update is skipped
            _loss(model, rank, t).backward()
        opt.step()
    return nn.utils.parameters_to_vector(model.parameters()).detach()


def _reference(name, topology, n, local, steps, skip_rank_step=None, *, skips=(), mixing=None):
    """Dense simulation of ``_train``; ``skips`` are (rank, step) pairs whose update is skipped,
    ``mixing`` replaces the topology's ``W(t)``."""
    _, _, kind, hyper = OPTIMIZERS[name]
    model = _model()
    sizes = [p.numel() for p in model.parameters()]
    split = sum(sizes[:2])  # group 0: the first Linear's weight and bias
    segments = [Segment(0, split, hyper), Segment(split, sum(sizes), {**hyper, **GROUP1})]
    x0 = nn.utils.parameters_to_vector(model.parameters()).detach().repeat(n, 1)
    skipped = set(skips) | ({skip_rank_step} if skip_rank_step else set())

    grads = worker_gradients(model, _loss)

    if mixing is None:
        mixing = get_topology(topology, n, local).mixing_matrix
    return simulate(
        kind, mixing, x0, grads, segments, steps, has_grad=lambda rank, t: (rank, t) not in skipped
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("topology, n, local", TOPOLOGIES, ids=lambda v: str(v))
def test_matches_dense_reference(name, topology, n, local):
    got = torch.stack(run_world(_train, n, name, topology, local, STEPS, None))
    want = _reference(name, topology, n, local, STEPS)
    assert not torch.allclose(want[0], want[-1]), "ranks should differ: the test would be vacuous"
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["DSGD", "DecentralizedAdamW", "AccumAdam"])
def test_rank_without_gradient_still_gossips(name):
    # rank 1 has no gradient at step 7: it skips its update but must take part in round 8,
    # or its neighbours deadlock (the harness turns a hang into a timeout error)
    got = torch.stack(run_world(_train, 4, name, "ring", 1, 12, (1, 7), timeout=60))
    want = _reference(name, "ring", 4, 1, 12, skip_rank_step=(1, 7))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

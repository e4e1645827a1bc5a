"""The one-process simulation of many workers (``benchmarks/_sim*.py``) against independent references.

* One worker: the simulated AdamW is torch.optim.AdamW, and the simulated AccumAdamW is the
  package's ``AccumAdamW``, on the character workload's model with the harness's clipping.
* Four gloo ranks (2 nodes x 2) running the package's ``DecentralizedAdamW`` with int8 gossip on
  ``one-peer-exp`` and exact gossip on ``ring``: every rank's parameters after a few steps are the
  simulation's rows, to float tolerance (the simulation is what the many-worker tables rest on).
* the simulated compressed round keeps the rows' sum; global averages fall on
  the rounds the spec names.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from _harness import run_world

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _sim  # noqa: E402  (the benchmarks import each other by these names)
import _sim_methods  # noqa: E402

LR, STEPS = 6e-3, 5


def _assert_agree(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to float tolerance but for a few coordinates whose gradient is rounding noise (a
    key bias, which softmax ignores): there Adam's ``m / (sqrt(v) + eps)`` turns a difference in
    the last place into one of up to a step (the rate). A wrong rule moves most coordinates."""
    off = (got - want).abs() > 1e-5 + 1e-4 * want.abs()
    assert off.float().mean() < 0.005, f"{int(off.sum())} of {off.numel()} values differ"
    assert (got - want).abs().max() < 3 * 3 * LR


def _task(n: int, lws: int = 1) -> _sim.Task:
    return _sim.Task("char", n, seed=0, global_batch=8, val_batches=1, local_world_size=lws)


def _simulated(spec: str, n: int, lws: int = 1, steps: int = STEPS) -> torch.Tensor:
    task = _task(n, lws)
    method = _sim_methods.Method(spec, task, LR)
    for t in range(steps):
        method.step(t, 1.0)
    return method.x


def _torch_rows(task: _sim.Task, opt_of, rank: int = 0, steps: int = STEPS) -> torch.Tensor:
    """``steps`` steps of a torch optimizer on ``task``'s model, clipped as the harness clips."""
    import torch.nn.functional as F
    from torch.nn.utils import parameters_to_vector

    torch.manual_seed(task.seed)
    model = task.work.make_model()
    params = list(model.parameters())
    opt = opt_of(params)
    for t in range(steps):
        x, y = task.batch(rank, t)
        opt.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    return parameters_to_vector(params).detach()


def _groups(params):
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip


def test_one_worker_is_torch_adamw():
    task = _task(1)
    want = _torch_rows(
        task, lambda ps: torch.optim.AdamW(_groups(ps), lr=LR * 2, betas=(0.9, 0.95))
    )
    got = _simulated("decent:complete", 1)[0]
    assert not torch.equal(want, task.start)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_one_worker_accum_is_the_packages_accum_adamw():
    import decent_optim

    task = _task(1)
    want = _torch_rows(task, lambda ps: decent_optim.AccumAdamW(
        _groups(ps), lr=LR * 3, betas=(0.9, 0.98), accum_iter=2, fused=False), steps=6)  # fmt: skip
    got = _simulated("decent:complete:x3:accum2:beta2=0.98", 1, steps=6)[0]
    _assert_agree(got, want)
    adam = _simulated("decent:complete:x3:beta2=0.98", 1, steps=6)[0]
    with pytest.raises(AssertionError, match="values differ"):
        _assert_agree(adam, want)


def _ranks(
    rank: int, world: int, topology: str, compression: str | None, steps: int = STEPS
) -> torch.Tensor:
    import decent_optim

    task = _task(world, 2)
    return _torch_rows(task, lambda ps: decent_optim.DecentralizedAdamW(
        _groups(ps), lr=LR * 3, betas=(0.9, 0.95), topology=topology, compression=compression,
        local_world_size=2), rank=rank, steps=steps)  # fmt: skip


@pytest.mark.parametrize(
    "topology,codec",
    [("ring", None), ("one-peer-exp", "int8"), ("base-4", "int8"), ("complete", "int8")],
)
def test_four_ranks_are_the_simulated_rows(topology, codec):
    ranks = torch.stack(run_world(_ranks, 4, topology, codec, timeout=300))
    spec = f"decent:{topology}{'+' + codec if codec else ''}:x3"
    rows = _simulated(spec, 4, lws=2)
    start = _task(4).start
    assert (ranks[0] - ranks[1]).abs().max() > 1e-4  # the workers differ: a real test of mixing
    assert (rows - start).abs().max() > 1e-3
    for r in range(4):
        _assert_agree(rows[r], ranks[r])
    with pytest.raises(AssertionError, match="values differ"):
        _assert_agree(rows[0], ranks[1])


def test_a_compressed_round_keeps_the_sum_and_moves_toward_the_mean():
    gen = torch.Generator().manual_seed(0)
    gossip = _sim_methods.Gossip(_sim_methods.topology_groups("one-peer-exp", 8, 2), 2, "int8")
    x = torch.randn(8, 5000, generator=gen)
    for r in range(6):
        before = x.clone()
        x += 0.01 * torch.randn(8, 5000, generator=gen)  # local progress between rounds
        noisy = x.clone()
        gossip.mix_(x, r)
        torch.testing.assert_close(x.sum(0), noisy.sum(0), rtol=0, atol=1e-4)
        assert not torch.equal(x, before)
    spread = (x - x.mean(0)).norm() / (noisy - noisy.mean(0)).norm()
    assert spread < 1.0


def test_global_averages_fall_on_the_rounds_named():
    task = _task(4)
    dense = _sim_methods.Method("decent:ring:pga3", task, LR)
    assert [t for t in range(10) if dense._global(t)] == [3, 6, 9]
    early = _sim_methods.Method("decent:ring:pga2:pgaw6:pgal4", task, LR)
    assert [t for t in range(13) if early._global(t)] == [2, 4, 8, 12]
    with pytest.raises(SystemExit, match="kinds"):
        _sim_methods.parse("allreduce:ring")


def test_vcorr_estimates_the_second_moment_of_a_mean_of_n_gradients():
    """A stationary stream g = mu + sigma * noise: vcorr<n>'s mean step is m / sqrt(v_eff) with
    v_eff = mu^2 + c sigma^2, where c = r + (1 - r) / n and r = (1 - b1) / (1 + b1) is the noise
    an EMA of weight 1 - b1 keeps in m^2 (AdamW's is mu / sqrt(mu^2 + sigma^2))."""
    gen = torch.Generator().manual_seed(0)
    mu, n, lr, b1 = torch.linspace(-1, 1, 4000), 16, 1e-4, 0.9
    x = torch.zeros(1, 4000)
    rule = _sim_methods.AdamW(x, torch.zeros(4000), (b1, 0.999), share=n)
    start = None
    for t in range(4000):
        if t == 2000:
            start = x.clone()
        rule.step(x, (mu + torch.randn(4000, generator=gen)).unsqueeze(0), lr)
    step = (start - x)[0] / lr / 2000
    r = (1 - b1) / (1 + b1)
    want = mu / (mu.square() + r + (1 - r) / n).sqrt()
    plain = mu / (mu.square() + 1).sqrt()
    assert (step - want).abs().mean() < 0.04  # the ratio of noisy EMAs: a mean, not a bound
    assert (step - plain).abs().mean() > 0.15


@pytest.mark.parametrize("k", [2, 4, 16])
def test_vmix_estimates_the_squared_mean_of_all_workers_from_one_group(k):
    """Monte Carlo: 16 workers' gradients mu + s * noise; from a group of k alone the estimate's
    mean is mu^2 + s^2 / 16, what the square of all 16 workers' mean averages (a group's own
    mean square, mu^2 + s^2 / k, is not)."""
    gen = torch.Generator().manual_seed(0)
    n, draws, mu, s = 16, 10000, torch.tensor([0.0, 0.5, -1.0]), torch.tensor([1.0, 1.5, 0.5])
    groups = [tuple(range(i, i + k)) for i in range(0, n, k)]
    est = torch.zeros(n, 3, dtype=torch.float64)
    for _ in range(draws // 100):
        g = mu + s * torch.randn(100, n, 3, generator=gen)
        est += torch.stack([_sim_methods.mean_square(gi, groups) for gi in g]).double().sum(0)
    est = est.mean(0) / draws  # the n / k groups' estimates are independent draws too
    want = (mu.square() + s.square() / n).double()
    assert torch.allclose(est, want, atol=0.02, rtol=0.03), (est, want)
    if k < n:
        own_group = (mu.square() + s.square() / k).double()
        assert (est - own_group).abs().max() > 0.1
    one = mu + s * torch.randn(n, 3, generator=gen)
    if k == n:  # the whole world in one group: the mean's square itself
        got = _sim_methods.mean_square(one, groups)
        assert torch.allclose(got, one.mean(0).square().expand(n, 3))


def test_vmix_gives_every_worker_ddps_step_on_a_stationary_stream():
    """16 rows, each its own noise, paired anew every step: with ``vmix``'s second moment each
    row's mean step is DDP's, mu / sqrt(mu^2 + s^2 / n), not AdamW's on its own gradient,
    mu / sqrt(mu^2 + s^2)."""
    gen = torch.Generator().manual_seed(1)
    n, p, lr = 16, 400, 1e-4
    mu = torch.linspace(-1, 1, p)
    x = torch.zeros(n, p)
    rule = _sim_methods.AdamW(x, torch.zeros(p), (0.9, 0.999))
    prev, start = None, None
    for t in range(1500):
        if t == 500:
            start = x.clone()
        g = mu + torch.randn(n, p, generator=gen)
        perm = torch.randperm(n, generator=gen).tolist()
        groups = [tuple(perm[i : i + 2]) for i in range(0, n, 2)]
        u = g.square() if prev is None else _sim_methods.mean_square(prev, groups)
        rule.step(x, g, lr, u)
        prev = g
    step = ((start - x) / lr / 1000).mean(0)
    ddp = mu / (mu.square() + 1 / n).sqrt()
    own = mu / (mu.square() + 1).sqrt()
    assert (step - ddp).abs().mean() < 0.05
    assert (step - own).abs().mean() > 0.2


def test_the_table_compares_each_run_with_ddp_on_its_own_schedule():
    """A results file holding two schedules: each run's multiple is of its own schedule's DDP."""
    import simulate

    def row(method, steps, reached, loss):
        return {"workload": "char", "workers": 4, "seed": 0, "steps": steps, "warmup": 8,
                "method": method, "steps_to_target": reached, "final_loss": loss,
                "curve": [[steps, loss]]}  # fmt: skip

    rows = [row("ddp", 480, None, 0.5), row("ddp", 96, None, 1.5),
            row("decent:ring", 96, 120, 1.5), row("decent:ring", 480, 600, 0.5)]  # fmt: skip
    lines = simulate.table(rows).splitlines()[2:]
    assert "120 (1.25x)" in lines[0] and "+0.0%" in lines[0]
    assert "600 (1.25x)" in lines[1] and "+0.0%" in lines[1]

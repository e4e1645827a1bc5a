"""Update rules through their contract (keys, update with a pending mix and GradScaler values),
against torch.optim's functional kernels and, for AccumAdam, the plain reference.

Every rule is driven the way the engine drives it: its state starts at zero in flat buffers, and
each step hands it a batch -- a whole bucket as one flat tensor, a whole bucket as per-parameter
views, or some of its parameters -- with the round's mix still to apply. The expected values come
from torch.optim.adam.adam / torch.optim.sgd.sgd applied parameter by parameter to the mixed
values (or from tests/reference.py), never from decent_optim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from reference import RefState
from reference import accum_adam as reference_accum_adam
from torch.optim.adam import adam as torch_adam
from torch.optim.sgd import sgd as torch_sgd

from decent_optim.flat import FlatParams
from decent_optim.gossip import PendingMix
from decent_optim.rules import AccumAdamRule, AdamRule, Amp, Batch, SgdRule

SHAPES = [(5, 3), (4,), (2, 3, 2), (1,)]
STEPS = 9


def _group(rule, **kw):
    base = dict(lr=0.02, weight_decay=0.0, maximize=False, foreach=None, fused=False)
    if isinstance(rule, SgdRule):
        base.update(momentum=0.0, dampening=0.0, nesterov=False)
    else:
        base.update(betas=(0.8, 0.95), eps=1e-8, amsgrad=False, decoupled_weight_decay=False)
        if isinstance(rule, AccumAdamRule):
            base.update(accum_iter=1)
    base.update(kw)
    return base


@dataclass
class _Torch:
    """Per-parameter copies stepped by torch's functional kernel (the reference)."""

    params: list[torch.Tensor]
    state: list[dict] = field(default_factory=list)

    def step(self, rule, group, grads, mixed, active):
        for k in range(len(self.params)):
            self.params[k] = mixed[k].clone()
            if k not in active:
                continue
            st, p, g = self.state[k], self.params[k], grads[k]
            if isinstance(rule, SgdRule):
                bufs = [st.get("momentum_buffer")]
                torch_sgd(
                    [p], [g], bufs, weight_decay=group["weight_decay"],
                    momentum=group["momentum"], lr=group["lr"], dampening=group["dampening"],
                    nesterov=group["nesterov"], maximize=group["maximize"], foreach=False,
                )  # fmt: skip
                if group["momentum"]:
                    st["momentum_buffer"] = bufs[0]
                continue
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                st.setdefault(key, torch.zeros_like(p))
            st.setdefault("step", torch.tensor(0.0, dtype=torch.float64))
            torch_adam(
                [p], [g], [st["exp_avg"]], [st["exp_avg_sq"]], [st["max_exp_avg_sq"]],
                [st["step"]], foreach=False, amsgrad=group["amsgrad"],
                beta1=group["betas"][0], beta2=group["betas"][1], lr=group["lr"],
                weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                decoupled_weight_decay=group["decoupled_weight_decay"],
            )  # fmt: skip


def _batch(bucket, keys, grads, active, flat, counted, fresh):
    """A batch as the engine hands it over (built here from the bucket's own buffers)."""
    counters, step_views = bucket.steps() if counted else (None, [])
    if flat:
        buf = torch.empty_like(bucket.data)
        for view, g in zip(bucket.views(buf), grads):
            view.copy_(g)
        return Batch(
            bucket, [bucket.data], [buf], {k: [bucket.state(k)[0]] for k in keys},
            step_views[:1], counters, None, fresh[:1], whole=True, flat=True,
        )  # fmt: skip
    whole = len(active) == len(bucket.params)
    return Batch(
        bucket,
        [bucket.params[k] for k in active],
        [grads[k] for k in active],
        {key: [bucket.state(key)[1][k] for k in active] for key in keys},
        [step_views[k] for k in active] if counted else [],
        counters if whole else None,
        None,
        [fresh[k] for k in active],
        whole=whole,
        flat=False,
    )


def _run(rule, group, form, *, mix_factor=0.5, amp_at=None, fold_check=True):
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
    ref = _Torch([p.clone() for p in params], [{} for _ in params])
    bucket = FlatParams([[p.requires_grad_() for p in params]], bucket_cap_mb=1).buckets[0]
    keys = rule.keys(group)
    fresh = [True] * len(params)
    for t in range(STEPS):
        grads = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
        active = [0, 2, 3] if form == "partial" and t % 3 == 1 else list(range(len(params)))
        peer = torch.randn(bucket.numel, generator=gen, dtype=torch.float64)
        own = bucket.data.detach().clone()
        mixed_flat = (own + peer) * mix_factor
        mixed = [v.clone() for v in bucket.views(mixed_flat)]
        batch = _batch(bucket, keys, grads, active, form == "flat", rule.counts_steps, fresh)
        amp = Amp()
        if t == amp_at:  # a GradScaler step that found inf: the mix happens, the update not
            amp = Amp(torch.tensor(4.0), torch.tensor(1.0))  # float32, as GradScaler keeps them
        elif amp_at is not None:
            amp = Amp(torch.tensor(4.0), torch.tensor(0.0))
            batch.grads = [g * 4.0 for g in batch.grads]
        mix = PendingMix(mix_factor, peer) if batch.whole else PendingMix()
        if not batch.whole:  # the engine finishes the mix before a partial batch
            bucket.data.copy_(mixed_flat)
        rule.update(batch, group, mix=mix, amp=amp)
        if t == amp_at:
            ref.params = [m.clone() for m in mixed]
        else:
            ref.step(rule, group, grads, mixed, active)
            for k in active:
                fresh[k] = False
    return bucket, ref


ADAM_GROUPS = [
    dict(),
    dict(weight_decay=0.1),
    dict(weight_decay=0.1, decoupled_weight_decay=True),
    dict(amsgrad=True, maximize=True, weight_decay=0.05, decoupled_weight_decay=True),
]
SGD_GROUPS = [
    dict(),
    dict(weight_decay=0.1, maximize=True),
    dict(momentum=0.9, weight_decay=0.01),
    dict(momentum=0.9, nesterov=True),
    dict(momentum=0.5, dampening=0.3),
]
CASES = (
    [(AdamRule(), g) for g in ADAM_GROUPS]
    + [(SgdRule(), g) for g in SGD_GROUPS]
    + [(AccumAdamRule(), g) for g in ADAM_GROUPS]  # accum_iter=1: exactly Adam
)


def _ids(value):
    return str(value) if isinstance(value, (dict, str)) else type(value).__name__


# a flat batch carries one first-step flag, which SGD's momentum cannot share between parameters
# that start at different steps; SGD takes per-parameter lists anyway (its flatten() is False)
FORMS = [
    (rule, hyper, form)
    for rule, hyper in CASES
    for form in ("flat", "lists", "partial")
    if not (form == "flat" and isinstance(rule, SgdRule) and hyper.get("momentum"))
]


@pytest.mark.parametrize("rule, hyper, form", FORMS, ids=_ids)
@torch.no_grad()
def test_rule_matches_torch_functional_kernels(rule, hyper, form):
    group = _group(rule, **hyper)
    bucket, ref = _run(rule, group, form)
    for view, want in zip(bucket.views(bucket.data.detach()), ref.params):
        # the same arithmetic; the mix's factor folded into the decay moves the last bits only
        torch.testing.assert_close(view, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("rule, hyper", [c for c in CASES if not c[1].get("momentum")][:9])
@torch.no_grad()
def test_a_step_gradscaler_skips_changes_nothing_but_the_mix(rule, hyper):
    group = _group(rule, **hyper)
    bucket, ref = _run(rule, group, "lists", amp_at=4)
    for view, want in zip(bucket.views(bucket.data.detach()), ref.params):
        torch.testing.assert_close(view, want, rtol=0, atol=1e-12)
    if rule.counts_steps:  # the skipped step is not counted
        assert bucket.steps()[0].tolist() == [STEPS - 1] * len(SHAPES)


def test_sgd_keeps_no_state_without_momentum_and_a_buffer_with_it():
    rule = SgdRule()
    assert rule.keys(_group(rule)) == ()
    assert rule.keys(_group(rule, momentum=0.9)) == ("momentum_buffer",)
    assert not rule.counts_steps


@pytest.mark.parametrize("accum_iter", [2, 3])
@pytest.mark.parametrize(
    "hyper",
    [dict(weight_decay=0.1), dict(weight_decay=0.1, decoupled_weight_decay=True, maximize=True)],
    ids=["L2", "decoupled-maximize"],
)
@pytest.mark.parametrize("form", ["flat", "partial"])
@torch.no_grad()
def test_accum_adam_matches_the_reference(accum_iter, hyper, form):
    rule = AccumAdamRule()
    group = _group(rule, accum_iter=accum_iter, **hyper)
    gen = torch.Generator().manual_seed(1)
    params = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
    refs = [RefState() for _ in params]
    xs = [p.reshape(-1).clone() for p in params]
    bucket = FlatParams([[p.requires_grad_() for p in params]], bucket_cap_mb=1).buckets[0]
    keys = rule.keys(group)
    reference_hyper = dict(
        lr=group["lr"], accum_iter=accum_iter, betas=group["betas"], eps=group["eps"],
        weight_decay=group["weight_decay"], decoupled=group["decoupled_weight_decay"],
        maximize=group["maximize"],
    )  # fmt: skip
    for t in range(11):
        grads = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
        active = [0, 2, 3] if form == "partial" and t == 4 else list(range(len(params)))
        batch = _batch(
            bucket, keys, grads, active, form == "flat" and len(active) == 4, True, [False] * 4
        )
        rule.update(batch, group, mix=PendingMix(), amp=Amp())
        for k in active:
            refs[k].steps += 1
            xs[k] = reference_accum_adam(xs[k], grads[k].reshape(-1), refs[k], **reference_hyper)
    for view, x in zip(bucket.views(bucket.data.detach()), xs):
        torch.testing.assert_close(view.reshape(-1), x, rtol=0, atol=1e-12)


@torch.no_grad()
def test_accum_adam_compiled_step_matches_the_eager_step():
    # fused=True compiles the step (and the pair's addend) into one pass; fused=False takes the
    # sliced eager path. Both must give the same values up to rounding.
    results = []
    for fused in (False, True):
        rule = AccumAdamRule()
        group = _group(
            rule, accum_iter=3, weight_decay=0.1, decoupled_weight_decay=True, fused=fused
        )
        bucket, _ = _run(rule, group, "flat" if not fused else "lists", mix_factor=0.5)
        results.append(bucket.data.detach().clone())
        results.append(torch.cat([bucket.state(k)[0] for k in rule.keys(group)]))
    torch.testing.assert_close(results[2], results[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(results[3], results[1], rtol=0, atol=1e-12)


def test_reference_sanity_accum_adam_with_one_step_windows_is_adam():
    # guards the reference the tests above lean on
    x, g = (
        torch.tensor([1.0, -2.0], dtype=torch.float64),
        torch.tensor([0.5, 0.25], dtype=torch.float64),
    )
    st = RefState(steps=1)
    got = reference_accum_adam(x, g, st, lr=0.1, accum_iter=1, betas=(0.9, 0.99))
    m, v = 0.1 * g, 0.01 * g * g
    want = x - 0.1 * (m / 0.1) / (torch.sqrt(v / (1 - 0.99)) + 1e-8)
    assert torch.allclose(got, want) and not math.isnan(float(got.sum()))

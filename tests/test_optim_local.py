"""World size 1 (no process group): every optimizer is its torch.optim counterpart.

Also the parts of the optimizers that need no peers: flat buckets, argument errors, state.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import decent_optim as dopt

# (class, kwargs, torch counterpart, kwargs of the counterpart)
CASES = [
    (dopt.DSGD, dict(lr=0.1), torch.optim.SGD, {}),
    (dopt.DSGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01), torch.optim.SGD, {}),
    (dopt.DSGD, dict(lr=0.1, momentum=0.9, nesterov=True, maximize=True), torch.optim.SGD, {}),
    (dopt.DSGD, dict(lr=0.1, momentum=0.5, dampening=0.3), torch.optim.SGD, {}),
    (dopt.DecentralizedAdam, dict(lr=0.01), torch.optim.Adam, {}),
    (
        dopt.DecentralizedAdam,
        dict(lr=0.01, betas=(0.8, 0.9), weight_decay=0.1),
        torch.optim.Adam,
        {},
    ),
    (dopt.DecentralizedAdam, dict(lr=0.01, amsgrad=True, maximize=True), torch.optim.Adam, {}),
    (dopt.DecentralizedAdamW, dict(lr=0.01), torch.optim.AdamW, {}),
    (dopt.DecentralizedAdamW, dict(lr=0.01, weight_decay=0.3, amsgrad=True), torch.optim.AdamW, {}),
    (dopt.AccumAdam, dict(lr=0.01, weight_decay=0.1, accum_iter=1), torch.optim.Adam, {}),
    (
        dopt.AccumAdam,
        dict(lr=0.01, amsgrad=True, maximize=True, accum_iter=1),
        torch.optim.Adam,
        {},
    ),
    (dopt.AccumAdamW, dict(lr=0.01, weight_decay=0.1, accum_iter=1), torch.optim.AdamW, {}),
]
TORCH_ONLY = ("accum_iter",)


def _ids(case):
    cls, kwargs, *_ = case
    return f"{cls.__name__}({', '.join(f'{k}={v}' for k, v in kwargs.items())})"


def _params():
    torch.manual_seed(0)
    shapes = [(3, 4), (5,), (2, 3, 2), (1,)]
    return [torch.randn(s, dtype=torch.float64, requires_grad=True) for s in shapes]


def _groups(params):
    # three groups with their own lr and weight decay
    return [
        {"params": params[:2]},
        {"params": [params[2]], "lr": 0.003, "weight_decay": 0.2},
        {"params": [params[3]], "lr": 0.02},
    ]


@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("topology", ["complete", "ring", "one-peer-exp", "alternating-exp-ring"])
def test_world_size_one_matches_torch_optim(case, topology):
    cls, kwargs, torch_cls, _ = case
    mine, theirs = _params(), _params()
    torch_kwargs = {k: v for k, v in kwargs.items() if k not in TORCH_ONLY}
    a = cls(_groups(mine), **kwargs, topology=topology)
    b = torch_cls(_groups(theirs), **torch_kwargs)
    gen = torch.Generator().manual_seed(1)
    for t in range(50):
        for x, y in zip(mine, theirs):
            x.grad = torch.randn(x.shape, generator=gen, dtype=torch.float64)
            y.grad = x.grad.clone()
        if t % 9 == 4:  # a parameter without gradient is skipped, as torch skips it
            mine[1].grad = theirs[1].grad = None
        a.step()
        b.step()
    for x, y in zip(mine, theirs):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


def test_accum_adam_differs_from_adam_when_accumulating():
    # guards the test above: with accum_iter > 1 the moments lag, so the paths must part
    mine, theirs = _params(), _params()
    a = dopt.AccumAdam(mine, lr=0.01, accum_iter=4)
    b = torch.optim.Adam(theirs, lr=0.01)
    for _ in range(10):
        for x, y in zip(mine, theirs):
            x.grad = torch.randn_like(x)
            y.grad = x.grad.clone()
        a.step()
        b.step()
    assert not torch.allclose(mine[0], theirs[0])


def test_parameters_become_views_of_flat_buckets_and_training_works():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    before = list(model.parameters())
    values = [p.detach().clone() for p in before]
    opt = dopt.DecentralizedAdamW(model.parameters(), lr=0.05, bucket_cap_mb=100 / 2**20)
    after = list(model.parameters())
    assert all(p is q for p, q in zip(before, after)), "the Parameter objects must stay the same"
    for p, v in zip(after, values):
        torch.testing.assert_close(p.detach(), v)  # values kept
    starts, ends = {p.data_ptr() for p in after}, {p.data_ptr() + p.nbytes for p in after}
    assert starts & ends, "parameters should lie back to back in the memory of a flat bucket"
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_buckets_never_mix_dtypes():
    # each dtype keeps its own arithmetic: a bucket that cast bf16 to float32 (or back) would
    # round differently from torch.optim.Adam on the same bf16 tensor
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
    torch.manual_seed(0)
    mine = [torch.randn(7, dtype=d, requires_grad=True) for d in dtypes]
    theirs = [p.detach().clone().requires_grad_() for p in mine]
    a = dopt.DecentralizedAdam(mine, lr=0.1)
    b = torch.optim.Adam(theirs, lr=0.1, fused=True)
    for _ in range(3):
        for x, y in zip(mine, theirs):
            x.grad = torch.randn_like(x)
            y.grad = x.grad.clone()
        a.step()
        b.step()
    for x, y in zip(mine, theirs):
        assert x.dtype == y.dtype
        assert torch.equal(x, y), x.dtype


def test_channels_last_parameter_keeps_its_memory_format():
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    value = conv.weight.detach().clone()
    dopt.DSGD(conv.parameters(), lr=0.1)
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(conv.weight.detach(), value)


def test_named_parameters_are_accepted():
    model = nn.Linear(3, 2)
    opt = dopt.DecentralizedAdamW(model.named_parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    assert opt.param_groups[0]["param_names"] == ["weight", "bias"]


def test_state_dict_round_trip_keeps_training_identical():
    def run(steps, resume_at=None):
        torch.manual_seed(0)
        params = [torch.randn(4, 3, requires_grad=True), torch.randn(3, requires_grad=True)]
        opt = dopt.AccumAdamW(params, lr=0.01, accum_iter=3)
        gen = torch.Generator().manual_seed(5)
        for t in range(steps):
            if t == resume_at:
                saved = opt.state_dict()
                opt = dopt.AccumAdamW(params, lr=0.01, accum_iter=3)
                opt.load_state_dict(saved)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        return params

    for x, y in zip(run(10), run(10, resume_at=5)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_state_lives_in_flat_buffers_after_loading():
    params = [torch.randn(4, requires_grad=True), torch.randn(2, requires_grad=True)]
    opt = dopt.DecentralizedAdam(params, lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    opt.load_state_dict(opt.state_dict())
    s0, s1 = (opt.state[p]["exp_avg"] for p in params)
    assert s0.untyped_storage().data_ptr() == s1.untyped_storage().data_ptr()


def test_synchronize_without_peers_is_a_no_op():
    p = torch.randn(3, requires_grad=True)
    opt = dopt.DSGD([p], lr=0.1)
    p.grad = torch.ones_like(p)
    opt.step()
    before = p.detach().clone()
    opt.synchronize()
    torch.testing.assert_close(p.detach(), before, rtol=0, atol=0)
    assert (opt.rank, opt.world_size) == (0, 1)


def test_step_with_closure_returns_the_loss():
    p = torch.tensor([1.0, 2.0], requires_grad=True)
    opt = dopt.DSGD([p], lr=0.5)

    def closure():
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == pytest.approx(5.0)
    torch.testing.assert_close(p.detach(), torch.tensor([0.0, 0.0]))


# -- errors ---------------------------------------------------------------------------------------

ERRORS = [
    (dopt.DSGD, dict(lr=-0.1), ValueError, "Invalid learning rate: -0.1"),
    (dopt.DSGD, dict(lr=0.1, momentum=-1), ValueError, "Invalid momentum value: -1"),
    (dopt.DSGD, dict(lr=0.1, weight_decay=-1), ValueError, "Invalid weight_decay value: -1"),
    (dopt.DSGD, dict(lr=0.1, nesterov=True), ValueError, "Nesterov momentum requires a momentum"),
    (dopt.DecentralizedAdam, dict(lr=-1.0), ValueError, "Invalid learning rate: -1.0"),
    (dopt.DecentralizedAdam, dict(eps=-1e-8), ValueError, "Invalid epsilon value: -1e-08"),
    (
        dopt.DecentralizedAdam,
        dict(betas=(1.0, 0.9)),
        ValueError,
        "Invalid beta parameter at index 0: 1.0",
    ),
    (
        dopt.DecentralizedAdamW,
        dict(betas=(0.9, -0.1)),
        ValueError,
        r"Invalid beta parameter at index 1: -0\.1",
    ),
    (
        dopt.DecentralizedAdamW,
        dict(weight_decay=-0.5),
        ValueError,
        "Invalid weight_decay value: -0.5",
    ),
    (dopt.DecentralizedAdamW, dict(betas=0.9), TypeError, "betas must be a pair"),
    (dopt.DecentralizedAdam, dict(capturable=True), ValueError, "does not support capturable=True"),
    (dopt.AccumAdam, dict(accum_iter=0), ValueError, "accum_iter must be >= 1, got 0"),
    (dopt.AccumAdamW, dict(accum_iter=2.5), TypeError, "accum_iter must be an int"),
    (
        dopt.DecentralizedAdamW,
        dict(topology="star"),
        ValueError,
        r"unknown topology 'star'; valid names are 'complete', 'ring', 'one-peer-exp', 'alternating-exp-ring'",
    ),
    (dopt.DecentralizedAdamW, dict(topology=3), TypeError, "topology must be a name"),
    (dopt.DSGD, dict(bucket_cap_mb=0), ValueError, "bucket_cap_mb must be > 0, got 0"),
    (dopt.DSGD, dict(local_world_size=0), ValueError, "local_world_size must be a positive int"),
]


@pytest.mark.parametrize("cls, kwargs, exc, match", ERRORS, ids=lambda v: str(v)[:40])
def test_bad_arguments_raise_before_touching_parameters(cls, kwargs, exc, match):
    p = torch.randn(3, requires_grad=True)
    ptr = p.data_ptr()
    with pytest.raises(exc, match=match):
        cls([p], **kwargs)
    assert p.data_ptr() == ptr, "a rejected optimizer must leave the parameters alone"


def test_an_optimizer_built_before_init_process_group_under_torchrun_names_the_call(monkeypatch):
    # what torchrun sets for the second of two workers; the script forgot init_process_group
    for key, value in dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", RANK="1", LOCAL_RANK="1").items():
        monkeypatch.setenv(key, value)
    assert not torch.distributed.is_initialized()
    p = torch.randn(3, requires_grad=True)
    ptr = p.data_ptr()
    with pytest.raises(
        RuntimeError,
        match=r"WORLD_SIZE=2 .* no process group.*call torch\.distributed\.init_process_group\(\)",
    ):
        dopt.DSGD([p], lr=0.1)
    assert p.data_ptr() == ptr
    monkeypatch.setenv("WORLD_SIZE", "1")  # one worker: training alone is what was asked
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    dopt.DSGD([p], lr=0.1)


def test_sparse_gradients_are_rejected_at_step():
    emb = nn.Embedding(10, 3, sparse=True)
    opt = dopt.DecentralizedAdam(emb.parameters(), lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()


def test_add_param_group_after_construction_says_why_not():
    opt = dopt.DSGD([torch.randn(2, requires_grad=True)], lr=0.1)
    with pytest.raises(RuntimeError, match="cannot add parameter groups after construction"):
        opt.add_param_group({"params": [torch.randn(2, requires_grad=True)]})


def test_reassigned_parameter_data_is_taken_back_at_the_next_step():
    p, q = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3))
    opt = dopt.DSGD([p, q], lr=0.1)
    p.data = torch.zeros(3)  # same shape, dtype and device: the new values are p's
    p.grad, q.grad = torch.ones(3), torch.ones(3)
    opt.step()
    assert torch.equal(p, torch.full((3,), -0.1))
    with torch.no_grad():
        p.fill_(1.0)  # p aliases its bucket again: the next step starts from these values
    opt.step()
    assert torch.allclose(p, torch.full((3,), 0.9))


@pytest.mark.parametrize(
    "new, match",
    [
        (torch.zeros(4), r"shape \(3,\) .* got `.data` of shape \(4,\) after DSGD was built"),
        (torch.zeros(3, dtype=torch.float64), "is now torch.float64 on cpu: the model was moved"),
    ],
    ids=["shape", "dtype"],
)
def test_parameter_data_of_another_kind_is_an_error(new, match):
    p = nn.Parameter(torch.randn(3))
    opt = dopt.DSGD([p], lr=0.1)
    p.data = new
    p.grad = torch.ones_like(new)
    with pytest.raises(RuntimeError, match=match):
        opt.step()


def test_a_model_cast_after_the_optimizer_is_an_error_that_says_what_to_do():
    model = nn.Linear(2, 2)
    opt = dopt.DecentralizedAdamW(model.parameters(), lr=0.1)
    model.double()
    model(torch.ones(1, 2, dtype=torch.float64)).sum().backward()
    with pytest.raises(
        RuntimeError,
        match=r"build the optimizer after it, or move it back with `model.to\('cpu', torch.float32\)`",
    ):
        opt.step()


@pytest.mark.parametrize(
    "param, exc, match",
    [
        (torch.zeros(3, dtype=torch.complex64), TypeError, "complex parameters are not supported"),
        (torch.zeros(3, dtype=torch.int64), TypeError, "parameters must be floating point"),
        (torch.zeros(1, 3).expand(4, 3), ValueError, "overlaps itself or has gaps"),
    ],
    ids=["complex", "integer", "expanded"],
)
def test_parameters_that_cannot_be_flattened(param, exc, match):
    with pytest.raises(exc, match=match):
        dopt.DSGD([param], lr=0.1)


def test_process_group_without_distributed_is_an_error():
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        dopt.DSGD([torch.randn(2, requires_grad=True)], lr=0.1, process_group=object())


def test_accum_adam_in_bf16_equals_adam():
    # bf16 bases rounded after every operation lost their decay (0.999 v rounds back to v):
    # the step must round once, as torch's fused Adam does
    torch.manual_seed(0)
    mine = [nn.Parameter(torch.randn(64, 33).bfloat16())]
    theirs = [nn.Parameter(mine[0].detach().clone())]
    a = dopt.AccumAdamW(mine, lr=0.01, weight_decay=0.1, accum_iter=1)
    b = torch.optim.AdamW(theirs, lr=0.01, weight_decay=0.1, fused=True)
    for _ in range(50):
        mine[0].grad = torch.randn_like(mine[0])
        theirs[0].grad = mine[0].grad.clone()
        a.step()
        b.step()
    torch.testing.assert_close(mine[0], theirs[0], rtol=2**-5, atol=2**-7)
    assert (mine[0] != theirs[0]).float().mean() < 0.01


@pytest.mark.parametrize(
    "layout",
    [lambda g: g.contiguous(memory_format=torch.channels_last), lambda g: g.mT.contiguous().mT],
    ids=["channels_last", "transposed"],
)
def test_gradients_laid_out_unlike_their_parameter(layout):
    # torch's fused kernels read a parameter and its gradient in memory order
    torch.manual_seed(0)
    mine = [nn.Parameter(torch.randn(8, 3, 3, 3))]
    theirs = [nn.Parameter(mine[0].detach().clone())]
    a = dopt.DSGD(mine, lr=0.05, momentum=0.9)
    b = torch.optim.SGD(theirs, lr=0.05, momentum=0.9, foreach=False)
    for _ in range(3):
        g = torch.randn(8, 3, 3, 3)
        mine[0].grad, theirs[0].grad = layout(g), g
        assert mine[0].grad.stride() != mine[0].stride()
        a.step()
        b.step()
    torch.testing.assert_close(mine[0], theirs[0])

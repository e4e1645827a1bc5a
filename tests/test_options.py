"""decent_optim.optim.options: the shared keyword arguments and classes that are parents with
other defaults (DecentralizedAdamW is DecentralizedAdam with decoupled decay of 1e-2)."""

from __future__ import annotations

import inspect

import pytest
import torch

import decent_optim as dopt
from decent_optim.optim.options import Options, with_defaults


@pytest.mark.parametrize(
    "cls, torch_cls",
    [(dopt.DecentralizedAdamW, torch.optim.AdamW), (dopt.AccumAdamW, torch.optim.AdamW)],
)
def test_w_classes_show_torch_adamw_defaults(cls, torch_cls):
    mine = inspect.signature(cls).parameters
    theirs = inspect.signature(torch_cls).parameters
    for name in ("lr", "betas", "eps", "weight_decay", "amsgrad"):
        assert mine[name].default == theirs[name].default, name
    assert mine["decoupled_weight_decay"].default is True


def test_adamw_is_adam_with_decoupled_decay():
    gen = torch.Generator().manual_seed(0)
    a = [torch.randn(4, 3, generator=gen, dtype=torch.float64, requires_grad=True)]
    b = [a[0].detach().clone().requires_grad_()]
    opt_a = dopt.DecentralizedAdamW(a, lr=0.1)
    opt_b = dopt.DecentralizedAdam(b, lr=0.1, weight_decay=1e-2, decoupled_weight_decay=True)
    for _ in range(5):
        a[0].grad = torch.randn(4, 3, generator=gen, dtype=torch.float64)
        b[0].grad = a[0].grad.clone()
        opt_a.step()
        opt_b.step()
    assert torch.equal(a[0], b[0])
    assert isinstance(opt_a, dopt.DecentralizedAdam)


def test_every_shared_option_is_a_keyword_of_the_engine():
    engine = inspect.signature(dopt.DecentralizedOptimizer).parameters
    for name in Options.__annotations__:
        assert engine[name].kind is inspect.Parameter.KEYWORD_ONLY, name


def test_an_unknown_option_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="topolgy"):
        dopt.DSGD([torch.zeros(2, requires_grad=True)], lr=0.1, topolgy="ring")  # type: ignore[call-arg]


def test_with_defaults_rejects_a_name_the_function_lacks():
    def f(a, b=1, *, c=2):
        return a, b, c

    g = with_defaults(f, "g", {"b": 5, "c": 7})
    assert g(0) == (0, 5, 7)
    assert str(inspect.signature(g)) == "(a, b=5, *, c=7)"
    with pytest.raises(TypeError, match="no parameter named d"):
        with_defaults(f, "h", {"d": 1})

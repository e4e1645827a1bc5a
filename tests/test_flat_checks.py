"""Tests of decent_optim.flat_checks: which parameters may live in a flat bucket."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from decent_optim.flat_checks import check_disjoint, check_flattenable


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda p: [p, p], r"parameters 0 \(shape \(4,\)\) and 1 \(shape \(4,\)\) share memory"),
        (lambda p: [p, nn.Parameter(p.data)], r"0 \(shape \(4,\)\) and 1 \(shape \(4,\)\) share"),
        (lambda p: [nn.Parameter(p.data[:3]), nn.Parameter(p.data[2:])], "share memory"),
    ],
    ids=["twice", "same-memory", "overlap"],
)
def test_parameters_sharing_memory_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        check_disjoint(make(nn.Parameter(torch.zeros(4))))


def test_parameters_sharing_memory_are_named_when_names_are_given():
    base = torch.zeros(6)
    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(base[:4]), nn.Parameter(base[3:])]
    with pytest.raises(ValueError, match=r"parameters 1 \('b'\) and 2 \('c'\) share memory"):
        check_disjoint(params, ["a", "b", "c"])


def test_disjoint_views_of_one_tensor_may_be_parameters():
    base = torch.zeros(4)
    check_disjoint([nn.Parameter(base[:2]), nn.Parameter(base[2:])])


@pytest.mark.parametrize(
    "param, exc, match",
    [
        (torch.zeros(3, dtype=torch.complex64), TypeError, "complex parameters are not supported"),
        (torch.zeros(3, dtype=torch.int64), TypeError, "must be floating point"),
        (torch.zeros(1, 3).expand(4, 3), ValueError, "overlaps itself or has gaps"),
        (torch.zeros(4, 6)[:, ::2], ValueError, "overlaps itself or has gaps"),
    ],
    ids=["complex", "integer", "expanded", "strided-gaps"],
)
def test_parameters_that_cannot_live_in_a_bucket(param, exc, match):
    with pytest.raises(exc, match=match):
        check_flattenable(param)


def test_dense_permuted_parameters_can_live_in_a_bucket():
    check_flattenable(torch.zeros(3, 4).t())
    check_flattenable(torch.zeros(2, 3, 4, 5).permute(0, 2, 3, 1))

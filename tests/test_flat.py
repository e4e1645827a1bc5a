"""decent_optim.flat: parameters and state as views of flat buckets, per device, dtype and group."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from decent_optim.flat import (
    Bucket,
    FlatParams,
    _check_readoptable,
)
from decent_optim.flat_checks import check_disjoint


def _params(shapes, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in shapes]


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(1, 5), min_size=0, max_size=3), min_size=1, max_size=12),
    cap_elements=st.integers(1, 80),
)
def test_every_parameter_keeps_its_values_and_views_exactly_one_bucket(shapes, cap_elements):
    params = _params([tuple(s) for s in shapes])
    values = [p.detach().clone() for p in params]
    flat = FlatParams([params], bucket_cap_mb=cap_elements * 4 / 2**20)
    assert [p for b in flat.buckets for p in b.params] == params  # order kept, none lost
    for bucket in flat.buckets:
        # a bucket exceeds the cap only when it holds a single parameter
        assert bucket.numel <= cap_elements or len(bucket.params) == 1
        assert bucket.numel == sum(p.numel() for p in bucket.params)
        for p, offset in zip(bucket.params, bucket.offsets):
            # its stretch of the bucket's memory, under a storage object of its own size
            assert p.data_ptr() == bucket.data.data_ptr() + offset * p.element_size()
            assert p.untyped_storage().nbytes() == p.numel() * p.element_size()
    for p, v in zip(params, values):
        assert torch.equal(p.detach(), v)
    # writing the bucket writes the parameters, and the reverse
    for bucket in flat.buckets:
        bucket.data.fill_(3.0)
    assert all(bool((p == 3.0).all()) for p in params)
    with torch.no_grad():
        params[0].fill_(-1.0)
    bucket = flat.buckets[0]
    assert bool((bucket.data[: params[0].numel()] == -1.0).all())


def test_buckets_never_mix_dtypes_or_param_groups():
    a, b = _params([(3,), (4,)]), _params([(2,)], dtype=torch.float64)
    c = _params([(5,)])
    flat = FlatParams([a + b, c], bucket_cap_mb=1)
    kinds = [(bk.group_index, bk.dtype, len(bk.params)) for bk in flat.buckets]
    assert sorted(kinds, key=str) == sorted(
        [(0, torch.float32, 2), (0, torch.float64, 1), (1, torch.float32, 1)], key=str
    )


def test_memory_format_is_kept():
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    value = conv.weight.detach().clone()
    FlatParams([list(conv.parameters())], bucket_cap_mb=1)
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(conv.weight.detach(), value)


def test_state_buffers_are_laid_out_like_the_parameters():
    conv = nn.Conv2d(2, 3, 3).to(memory_format=torch.channels_last)
    bucket = FlatParams([list(conv.parameters())], bucket_cap_mb=1).buckets[0]
    flat, views = bucket.state("exp_avg")
    assert flat.shape == bucket.data.shape and not flat.any()
    assert [v.shape for v in views] == [p.shape for p in bucket.params]
    assert [v.stride() for v in views] == [p.stride() for p in bucket.params]
    views[0].fill_(2.0)  # a view writes its stretch of the flat buffer, in memory order
    assert torch.equal(flat[: conv.weight.numel()], torch.full((conv.weight.numel(),), 2.0))
    assert bucket.state("exp_avg")[0] is flat, "a state buffer is created once"
    segments = bucket.segments(flat)
    assert [s.numel() for s in segments] == [p.numel() for p in bucket.params]


def test_step_counters_are_one_float32_vector_with_a_view_per_parameter():
    bucket = FlatParams([_params([(2, 2), (3,), (1,)])], bucket_cap_mb=1).buckets[0]
    counters, views = bucket.steps()
    assert counters.dtype == torch.float32 and counters.shape == (3,)
    counters.add_(1)
    views[1].add_(1)
    assert [float(v) for v in views] == [1.0, 2.0, 1.0]
    assert all(v.dim() == 0 for v in views)


def test_a_parameter_given_new_data_is_taken_back_with_its_values():
    params = _params([(3,), (2,)])
    flat = FlatParams([params], bucket_cap_mb=1)
    assert not flat.moved()
    params[1].data = torch.tensor([5.0, 6.0])
    assert flat.moved()
    flat.readopt("DSGD")
    assert not flat.moved()
    assert flat.buckets[0].data[3:].tolist() == [5.0, 6.0]
    flat.buckets[0].data.fill_(1.0)  # aliases the bucket again
    assert params[1].tolist() == [1.0, 1.0]


@pytest.mark.parametrize(
    "new, match",
    [
        (torch.zeros(3), r"shape \(2,\) \(torch.float32 on cpu\) got `.data` of shape \(3,\)"),
        (
            torch.zeros(2, dtype=torch.float64),
            r"is now torch.float64 on cpu.*model.to\('cpu', torch.float32\)",
        ),
    ],
    ids=["shape", "dtype"],
)
def test_new_data_of_another_kind_is_refused_before_anything_changes(new, match):
    params = _params([(3,), (2,)])
    flat = FlatParams([params], bucket_cap_mb=1)
    params[0].data = torch.full((3,), 7.0)  # could be taken back, but the other cannot
    params[1].data = new
    with pytest.raises(RuntimeError, match=match):
        flat.readopt("DSGD")
    assert not bool((flat.buckets[0].data == 7.0).any()), "nothing is copied before the check"


def test_new_data_on_another_device_is_refused():
    # p.data cannot be set to another device type on this machine (CPU only), so the check is
    # called with the tensor a parameter moved to cuda would hold
    alias = _params([(2,)])[0].detach()
    with pytest.raises(RuntimeError, match=r"is now torch.float32 on meta: the model was moved"):
        _check_readoptable(torch.zeros(2, device="meta"), alias, "DSGD")


def test_aliases_have_their_own_storage_and_keep_the_bucket_alive():
    conv = nn.Conv2d(3, 4, 1).to(memory_format=torch.channels_last)  # size-1 dims: strides kept
    strides = conv.weight.stride()
    flat = FlatParams([list(conv.parameters())], bucket_cap_mb=1)
    assert conv.weight.stride() == strides
    data = flat.buckets[0].data
    del flat
    data.fill_(2.0)
    assert bool((conv.weight == 2.0).all()) and bool((conv.bias == 2.0).all())


def test_parameters_on_a_device_dlpack_does_not_cover_stay_plain_views():
    params = [nn.Parameter(torch.empty(s, device="meta")) for s in [(3,), (2, 2)]]
    check_disjoint(params)  # no memory, nothing shared
    flat = FlatParams([params], bucket_cap_mb=1)
    assert [p.shape for p in params] == [(3,), (2, 2)] and params[1].device.type == "meta"
    assert flat.buckets[0].numel == 7


def test_empty_parameters_take_no_memory_of_the_bucket():
    params = _params([(0,), (2,), (3, 0)])
    flat = FlatParams([params], bucket_cap_mb=1)
    assert flat.buckets[0].numel == 2 and [p.shape for p in params] == [(0,), (2,), (3, 0)]
    assert not flat.moved()


def test_view_of_uses_the_layout_of_the_given_tensor():
    like = torch.empty(2, 3).t()  # strides (1, 3)
    flat = torch.arange(10.0)
    view = Bucket.view_of(flat, like, 4)
    assert view.stride() == like.stride() and view.shape == like.shape
    assert view[1, 0].item() == 5.0

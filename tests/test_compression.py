"""Compressed gossip (``compression="bf16"/"int8"``): codecs, the mix, and gloo ranks end to end.

The multi-process runs are compared with ``reference.CompressedMixing``, a dense simulation of
the same scheme written from the design notes (public copies, error feedback, parts per node).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from _harness import run_world
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import CompressedMixing, Segment, quantized, simulate

import decent_optim as dopt
from decent_optim.gossip import codecs
from decent_optim.gossip.codecs import CHUNK, Bf16, Int8
from decent_optim.gossip.compressed import GAMMA
from decent_optim.gossip.copies import mix_shard_
from decent_optim.gossip.nodes import Parts
from decent_optim.topologies import CustomTopology
from decent_optim.topologies import get as get_topology

NUMEL = 3000  # three int8 chunks, the last one partial; two shards of 2048 + 952 for L = 2


# -- codecs (pure) ------------------------------------------------------------------------------
def _differences(seed: int, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Two buffers whose difference has a different magnitude in every chunk, and some zeros."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(numel, generator=gen, dtype=torch.float64)
    b = a + torch.randn(numel, generator=gen, dtype=torch.float64) * torch.logspace(
        -6, 2, numel, dtype=torch.float64
    )
    b[: min(numel, 7)] = a[: min(numel, 7)]  # a run of exact zeros
    return a.to(dtype), b.to(dtype)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 3 * CHUNK + 5),
    st.integers(0, 2**31 - 1),
    st.sampled_from([torch.float32, torch.float64]),
)
def test_int8_error_is_at_most_half_a_step_of_its_chunk(numel, seed, dtype):
    a, b = _differences(seed, numel, dtype)
    codec = Int8()
    payload = torch.empty(codec.nbytes(numel), dtype=torch.uint8)
    codec.encode_(a, b, payload)
    got = torch.zeros(numel, dtype=dtype)
    codec.decode_add_(payload, got)
    d = (a - b).double()
    for lo in range(0, numel, CHUNK):
        chunk, err = d[lo : lo + CHUNK], (got.double() - d)[lo : lo + CHUNK]
        step = chunk.abs().max() / 127
        # half a step, plus the rounding of the scale to float32 and of d to dtype
        assert err.abs().max() <= step * (0.5 + 1e-5) + chunk.abs().max() * 2e-7
    assert torch.equal(got[: min(numel, 7)], torch.zeros(min(numel, 7), dtype=dtype))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3 * CHUNK + 5), st.integers(0, 2**31 - 1))
def test_bf16_error_is_relative(numel, seed):
    a, b = _differences(seed, numel, torch.float32)
    codec = Bf16()
    payload = torch.empty(codec.nbytes(numel), dtype=torch.uint8)
    codec.encode_(a, b, payload)
    got = torch.zeros(numel)
    codec.decode_add_(payload, got)
    d = a - b
    assert ((got - d).abs() <= d.abs() * 2**-8).all()


@pytest.mark.parametrize("codec", [Bf16(), Int8()], ids=repr)
def test_decoding_is_the_same_for_every_holder(codec):
    """The sender (while encoding) and the receivers add the payload to copies that must stay
    bit-identical."""
    a, b = _differences(3, 2 * codecs.SLICE + 77, torch.float32)
    payload = torch.empty(codec.nbytes(a.numel()), dtype=torch.uint8)
    codec.encode_(a, b, payload)
    received = payload.clone()  # what crosses the wire
    mine, theirs = b.clone(), b.clone()
    codec.encode_(a, mine, payload, absorb=True)  # the sender's copy, while encoding
    assert torch.equal(payload, received)
    for lo in range(0, a.numel(), CHUNK * 5):  # decoded in other slices than the sender's
        codec.decode_add_(received, theirs, lo, min(lo + CHUNK * 5, a.numel()))
    assert torch.equal(mine, theirs)


@pytest.mark.parametrize("name", ["bf16", "int8"])
def test_codecs_agree_with_the_reference_quantizer(name):
    a, b = _differences(5, NUMEL, torch.float64)
    codec = codecs.get(name)
    payload = torch.empty(codec.nbytes(NUMEL), dtype=torch.uint8)
    codec.encode_(a, b, payload)
    got = torch.zeros(NUMEL, dtype=torch.float64)
    codec.decode_add_(payload, got)
    torch.testing.assert_close(got, quantized(name, a - b), rtol=0, atol=1e-12)


def test_payload_sizes():
    assert Bf16().nbytes(1000) == 2000
    assert Int8().nbytes(1000) == CHUNK + 4
    assert Int8().nbytes(3 * CHUNK + 1) == 4 * CHUNK + 16


@pytest.mark.parametrize(
    "value, error, match",
    [
        (
            "fp8",
            ValueError,
            r"compression must be None or one of 'bf16', 'int8', .* got 'fp8'",
        ),
        (8, TypeError, "compression must be None or one of .* got int"),
        (True, TypeError, "got bool"),
    ],
)
def test_bad_compression_is_refused_before_anything_happens(value, error, match):
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(error, match=match):
        dopt.DecentralizedAdamW([p], compression=value)


def test_compression_with_one_worker_is_plain_adamw():
    torch.manual_seed(0)
    x = torch.randn(5, requires_grad=True)
    y = x.detach().clone().requires_grad_()
    a = dopt.DecentralizedAdamW([x], lr=0.1, compression="int8")
    b = torch.optim.AdamW([y], lr=0.1)
    for _ in range(5):
        x.grad = torch.randn(5)
        y.grad = x.grad.clone()
        a.step()
        b.step()
    torch.testing.assert_close(x, y)


# -- the mix of one round (pure): the sum is kept, the copies agree ------------------------------
@settings(max_examples=30, deadline=None)
@given(
    st.integers(2, 4),  # parts
    st.integers(1, 3),  # ranks per part
    st.integers(1, 2 * CHUNK + 9),
    st.sampled_from(["bf16", "int8"]),
    st.integers(0, 2**31 - 1),
)
def test_every_round_keeps_the_sum_of_the_group(p, width, numel, name, seed):
    """Rounds of one group, simulated in one process with the strategy's own math for one shard
    (held by one member of each part); between the rounds every rank changes its values, as a
    local update would."""
    gen = torch.Generator().manual_seed(seed)
    codec = codecs.get(name)
    x = torch.randn(p * width, numel, generator=gen, dtype=torch.float64)
    copies = [[torch.zeros(numel, dtype=torch.float64) for _ in range(p)] for _ in range(p)]
    acc = torch.empty(min(codecs.SLICE, numel), dtype=torch.float64)
    for round_ in range(4):
        means = x.view(p, width, numel).mean(1)  # part a = ranks a * width ... (a + 1) * width - 1
        payloads = []
        for a in range(p):  # the holder of part a's shard encodes against its own copy
            if round_:
                out = torch.empty(codec.nbytes(numel), dtype=torch.uint8)
                codec.encode_(means[a], copies[a][a], out, absorb=True)
                payloads.append(out)
            else:  # the first round: exact values
                for h in range(p):
                    copies[h][a].copy_(means[a])
        mixed = torch.empty(p, numel, dtype=torch.float64)
        for a in range(p):
            row = mixed[a]
            row.copy_(means[a])
            m = row if width == 1 else row.clone()  # the strategy mixes a one-rank part in place
            theirs = [payloads[b] for b in range(p) if b != a] if round_ else None
            mix_shard_(row, m, copies[a], a, theirs, codec, acc)
        new = mixed.repeat_interleave(width, 0)  # the members gather the shard
        # exact arithmetic would keep the sum exactly; allow the rounding of float64 additions
        scale = x.abs().max() + new.abs().max()
        assert (new.sum(0) - x.sum(0)).abs().max() <= 1e-13 * scale * p * width
        for h in range(1, p):  # every holder has the same copies
            assert all(torch.equal(mine, theirs) for mine, theirs in zip(copies[h], copies[0]))
        x = new + torch.randn(x.shape, generator=gen, dtype=torch.float64) * 0.1


def test_parts_split_by_node_and_pair_shard_holders():
    parts = Parts((0, 1, 2, 3), rank=3, local_world_size=2)
    assert parts.parts == [(0, 1), (2, 3)]
    assert (parts.mine, parts.slot, parts.width) == (1, 1, 2)
    assert parts.counterparts() == [1] and parts.partners() == [(0, 2)]
    assert Parts((1, 2), 1, 2).parts == [(1,), (2,)]  # a ring pair across nodes
    assert not Parts((0, 1), 0, 2).crosses_nodes  # a pair inside one node
    assert Parts((0, 1, 2), 0, 2).parts == [(0,), (1,), (2,)]  # unequal parts: single ranks
    assert parts.shard(NUMEL, 0) == (0, 2048) and parts.shard(NUMEL, 1) == (2048, NUMEL)
    assert GAMMA == 1.0


# -- gloo ranks ---------------------------------------------------------------------------------
TARGETS_SEED = 99


def _targets(n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(TARGETS_SEED)
    return torch.randn(n, NUMEL, generator=gen, dtype=torch.float64) * 3


OPTIMIZERS = {
    "DSGD": (dopt.DSGD, dict(lr=0.1, momentum=0.5), "sgd", dict(lr=0.1, momentum=0.5)),
    "DecentralizedAdamW": (
        dopt.DecentralizedAdamW,
        dict(lr=0.05, weight_decay=0.1),
        "adam",
        dict(lr=0.05, weight_decay=0.1, decoupled=True),
    ),
}


def _train(rank, n, name, topology, local, compression, steps, resume_at):
    """Rank i minimises 0.5 * ||x - b_i||^2; optionally reloads its checkpoint at ``resume_at``."""
    cls, kwargs, *_ = OPTIMIZERS[name]
    b = _targets(n)[rank]
    x = torch.nn.Parameter(torch.zeros(NUMEL, dtype=torch.float64))
    opt = cls([x], **kwargs, topology=topology, local_world_size=local, compression=compression)
    for t in range(steps):
        if t == resume_at:
            opt.load_state_dict(opt.state_dict())
        x.grad = x.detach() - b
        opt.step()
    return x.detach()


def _reference(name, topology, n, local, compression, steps):
    _, _, kind, hyper = OPTIMIZERS[name]
    mixer = CompressedMixing(get_topology(topology, n, local), compression)
    targets = _targets(n)
    x0 = torch.zeros(n, NUMEL, dtype=torch.float64)
    return simulate(
        kind, None, x0, lambda x, t: x - targets, [Segment(0, NUMEL, hyper)], steps, mixer=mixer
    )


CASES = [
    ("ring", 4, 1),  # every pair crosses nodes
    ("ring", 4, 2),  # pairs inside a node exact, across compressed
    ("one-peer-exp", 4, 1),
    ("complete", 4, 2),  # two parts of two ranks
    ("alternating-exp-ring", 4, 2),
    ("alternating-exp-ring", 8, 2),  # two node pairs
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("compression", ["bf16", "int8"])
@pytest.mark.parametrize("topology, n, local", CASES, ids=str)
def test_dsgd_matches_the_dense_reference(topology, n, local, compression):
    got = torch.stack(run_world(_train, n, "DSGD", topology, local, compression, 25, None))
    want = _reference("DSGD", topology, n, local, compression, 25)
    assert not torch.allclose(want[0], want[-1])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)


@pytest.mark.multiprocess
@pytest.mark.parametrize("compression", ["bf16", "int8"])
@pytest.mark.parametrize("topology, n, local", [CASES[0], CASES[4]], ids=str)
def test_adamw_matches_the_dense_reference_also_after_resuming(topology, n, local, compression):
    got = torch.stack(
        run_world(_train, n, "DecentralizedAdamW", topology, local, compression, 20, 9)
    )
    # the public copies are saved and restored: the resumed run is the uninterrupted one
    want = _reference("DecentralizedAdamW", topology, n, local, compression, 20)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)


def _gossip_alone(rank, n, topology, local, compression, dtype, rounds):
    """lr = 0: steps only mix; every rank starts from values of its own, of every magnitude."""
    x = torch.nn.Parameter(torch.zeros(NUMEL, dtype=dtype))
    opt = dopt.DSGD([x], lr=0.0, topology=topology, local_world_size=local, compression=compression)
    gen = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        x.copy_(torch.randn(NUMEL, generator=gen, dtype=dtype) * torch.logspace(-3, 3, NUMEL))
    history = []
    for _ in range(rounds):
        x.grad = torch.zeros_like(x)
        opt.step()
        history.append(x.detach().clone())
    return torch.stack(history)


@pytest.mark.multiprocess
@pytest.mark.parametrize("compression", ["bf16", "int8"])
@pytest.mark.parametrize("topology, n, local", CASES, ids=str)
def test_every_round_keeps_the_mean_and_the_copies_reach_consensus(topology, n, local, compression):
    got = torch.stack(run_world(_gossip_alone, n, topology, local, compression, torch.float64, 40))
    mean = got.mean(0)  # (rounds, numel)
    # the quantisation error of one round of these values is ~1e-2 (int8) and ~1e-3 (bf16) of
    # their size; a round keeps the mean up to the rounding of float64 additions
    torch.testing.assert_close(mean, mean[:1].expand_as(mean), rtol=0, atol=1e-12 * 1e3)
    start = (got[:, 0] - mean[0]).norm()
    end = (got[:, -1] - mean[-1]).norm()
    # error feedback: the copies converge like exact gossip; rounding the values instead would
    # stall at the quantisation error (~1e-3 of the start for int8)
    assert end <= 1e-8 * start


@pytest.mark.multiprocess
def test_float32_parameters_reach_consensus_at_float32_precision():
    got = torch.stack(run_world(_gossip_alone, 4, "ring", 1, "int8", torch.float32, 40))
    mean = got.double().mean(0)
    assert (got[:, -1].double() - mean[-1]).abs().max() <= 1e-6 * mean[-1].abs().max()


def _custom(rank, n, compression):
    w = [[2 / 3, 1 / 3, 0], [1 / 3, 1 / 3, 1 / 3], [0, 1 / 3, 2 / 3]]
    p = torch.nn.Parameter(torch.zeros(4))
    try:
        dopt.DSGD([p], lr=0.1, topology=CustomTopology([w]), compression=compression)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.multiprocess
def test_arbitrary_weights_cannot_be_compressed():
    messages = run_world(_custom, 3, "int8")
    assert all("needs rounds that average uniform groups" in m for m in messages)
    assert run_world(_custom, 3, None) == [None] * 3


def _one_node(rank, n):
    p = torch.nn.Parameter(torch.zeros(4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dopt.DSGD([p], lr=0.1, topology="ring", local_world_size=2, compression="bf16")
    return [str(w.message) for w in caught]


@pytest.mark.multiprocess
def test_compression_inside_one_node_warns_that_it_does_nothing():
    for messages in run_world(_one_node, 2):
        assert any("has no effect" in m and "local_world_size=1" in m for m in messages)


# -- exact rounds by node (compression=None): one copy per direction on the slow link ----------
def _initial(n: int, dtype: torch.dtype) -> torch.Tensor:
    """The values ``_gossip_alone`` gives each rank."""
    rows = []
    for rank in range(n):
        gen = torch.Generator().manual_seed(rank)
        rows.append(torch.randn(NUMEL, generator=gen, dtype=dtype) * torch.logspace(-3, 3, NUMEL))
    return torch.stack(rows)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "topology, n, local",
    [("complete", 4, 2), ("alternating-exp-ring", 4, 2), ("alternating-exp-ring", 8, 2)],
    ids=str,
)
def test_exact_rounds_by_node_are_the_group_mean(topology, n, local):
    """Groups with several ranks on each of several nodes average by node (a shard per member)."""
    got = torch.stack(run_world(_gossip_alone, n, topology, local, None, torch.float64, 6))
    topo = get_topology(topology, n, local)
    x = _initial(n, torch.float64)
    scale = torch.logspace(-3, 3, NUMEL, dtype=torch.float64)  # means of such values can cancel
    for t in range(6):
        if t:  # round 0 is never run
            x = topo.mixing_matrix(t) @ x
        torch.testing.assert_close(got[:, t] / scale, x / scale, rtol=0, atol=1e-12)
        for group in topo.groups(t) if t else []:  # every member of a group: the same bits
            assert all(torch.equal(got[group[0], t], got[r, t]) for r in group)

"""Sparse and low-bit codecs (``int4``, ``int2``, ``rand<p>%``, ``top<p>%``, combinations).

The codecs are compared with a reference written here from the documented format (numpy,
the chunks one by one), the gloo runs with a dense float64 simulation of compressed gossip that
uses that reference, and the byte counts with sizes worked out by hand.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _harness import run_world
from hypothesis import example, given, settings
from hypothesis import strategies as st

import decent_optim as dopt
from decent_optim import runtime
from decent_optim.gossip import codec_base, codecs
from decent_optim.gossip.codecs import CHUNK, SLICE
from decent_optim.gossip.sparse_codecs import Quantized, RandomK, TopK
from decent_optim.runtime.wire import Spec
from decent_optim.topologies import get as get_topology

LEVELS = {8: 127, 4: 7, 2: 1}
NUMEL = 3000  # three chunks, the last partial; shards of 2048 + 952 for two ranks per node
NAMES = ["int4", "int2", "rand1%", "top1%", "rand1%+int4", "top1%+int2", "top10%+int8"]


def _kept(keep: str, percent: float, chunk: int) -> int:
    return chunk if keep == "all" else min(chunk, max(1, round(percent * chunk / 100)))


def _positions(keep: str, d: np.ndarray, k: int, seed: int, chunks: int, chunk: int) -> np.ndarray:
    """Kept positions per chunk (rows), from the documented rule."""
    if keep == "all":
        return np.tile(np.arange(chunk), (chunks, 1))
    if keep == "top":  # the k largest magnitudes (ties: any order, the values are equal)
        return np.argsort(-np.abs(d.reshape(chunks, chunk)), axis=1, kind="stable")[:, :k]
    gen = torch.Generator().manual_seed(seed & (2**63 - 1))  # the seed as the payload holds it
    perm = torch.randperm(chunk, generator=gen)[:k].numpy()
    offsets = torch.randint(0, chunk, (chunks, 1), generator=gen).numpy()
    return (perm[None, :] + offsets) % chunk


def reference(keep, percent, bits, chunk, a: torch.Tensor, b: torch.Tensor, seed: int):
    """What a holder adds for ``a - b``: numpy, in the buffers' precision, chunk by chunk."""
    dt = np.float32 if a.dtype == torch.float32 else np.float64
    n = a.numel()
    chunks = -(-n // chunk)
    d = np.zeros(chunks * chunk, dtype=dt)
    d[:n] = a.numpy() - b.numpy()
    k = _kept(keep, percent, chunk)
    where = _positions(keep, d, k, seed, chunks, chunk)
    out = np.zeros_like(d)
    for c in range(chunks):
        v = d[c * chunk + where[c]]
        if bits is None:
            got = v.astype(np.float32).astype(dt)
        else:
            level = LEVELS[bits]
            scale = np.float32(np.abs(v).max() / dt(level))
            inv = dt(1) / dt(scale) if scale > 0 else dt(0)
            q = np.clip(np.round(v * inv), -level, level)  # numpy rounds half to even, as torch
            got = q.astype(dt) * dt(scale)
        out[c * chunk + where[c]] = got
    return torch.from_numpy(out[:n].copy())


def _assert_equal_up_to_tied_positions(got, want, magnitude, chunk):
    """Top-k may keep any of the positions that tie at a chunk's k-th magnitude (the rule names
    the magnitudes, not an order among equal ones): where ``got`` and ``want`` differ, the chunk
    keeps the same magnitudes, and every differing position has the same magnitude."""
    pad = (-got.numel()) % chunk
    g, w, m = (torch.nn.functional.pad(x, (0, pad)).view(-1, chunk) for x in (got, want, magnitude))
    for row in (g != w).any(1).nonzero().flatten().tolist():
        differ = g[row] != w[row]
        assert torch.equal(g[row].abs().sort().values, w[row].abs().sort().values), row
        assert bool((m[row][differ] == m[row][differ][0]).all()), row


def _hand_nbytes(keep, percent, bits, chunk, n):
    chunks, k = math.ceil(n / chunk), _kept(keep, percent, chunk)
    per_value = 4 * k if bits is None else math.ceil(k * bits / 8)
    return (
        (8 if keep == "rand" else 0)
        + (0 if bits is None else 4 * chunks)
        + chunks * per_value
        + (2 * k * chunks if keep == "top" else 0)
    )


def _codec(keep, percent, bits, chunk):
    if keep == "all":
        return Quantized(bits, chunk)
    return (RandomK if keep == "rand" else TopK)(percent, bits, chunk)


KINDS = st.sampled_from(
    [("all", 100.0, 4), ("all", 100.0, 2)]
    + [
        (keep, p, bits)
        for keep in ("rand", "top")
        for p in (0.5, 1, 10, 37.5, 100)
        for bits in (None, 8, 4, 2)
    ]
)


# -- the codecs alone -----------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(
    KINDS,
    st.sampled_from([1, 2, 4, 16, 64, 1024]),  # chunk
    st.integers(1, 3 * 1024 + 5),  # numel: odd tails
    st.integers(0, 2**40),  # data and seed
    st.sampled_from([torch.float32, torch.float64]),
)
@example(("top", 0.5, None), 4, 1523, 38929240, torch.float32)  # two equal top values in a chunk
def test_decode_of_encode_is_the_reference_and_absorb_adds_the_same_bits(
    kind, chunk, n, seed, dtype
):
    keep, percent, bits = kind
    codec = _codec(keep, percent, bits, chunk)
    gen = torch.Generator().manual_seed(seed % 2**31)
    a = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
    b = (a.double() + torch.randn(n, generator=gen, dtype=torch.float64) * 10 ** (seed % 7 - 3)).to(
        dtype
    )
    b[: min(n, 5)] = a[: min(n, 5)]  # a run of exact zeros
    payload = torch.empty(codec.nbytes(n), dtype=torch.uint8)
    assert payload.numel() == _hand_nbytes(keep, percent, bits, chunk, n)
    codec.encode_(a, b, payload, seed=seed)
    got = torch.zeros(n, dtype=dtype)
    codec.decode_add_(payload, got)
    want = reference(keep, percent, bits, chunk, a, b, seed)
    if keep == "top":
        _assert_equal_up_to_tied_positions(got, want, (a - b).abs(), chunk)
    else:
        assert torch.equal(got, want)
    # absorb: the sender's copy takes exactly what every holder adds, and the payload is the same
    mine, theirs, again = b.clone(), b.clone(), torch.empty_like(payload)
    codec.encode_(a, mine, again, absorb=True, seed=seed)
    assert torch.equal(again, payload)
    codec.decode_add_(payload, theirs)
    assert torch.equal(mine, theirs)
    assert not bool(codec.nonfinite(payload))


@pytest.mark.parametrize("name", NAMES)
def test_a_range_of_chunks_decodes_alone(name):
    """Shard holders decode slices of a payload: the pieces add up to the whole, bit for bit."""
    codec = codecs.get(name)
    n = SLICE + 5 * CHUNK + 17
    a, b = torch.randn(n), torch.randn(n)
    payload = torch.empty(codec.nbytes(n), dtype=torch.uint8)
    codec.encode_(a, b, payload, seed=5)
    whole, pieces = torch.zeros(n), torch.zeros(n)
    codec.decode_add_(payload, whole)
    for lo in range(0, n, 3 * CHUNK):
        codec.decode_add_(payload, pieces, lo, min(lo + 3 * CHUNK, n))
    assert torch.equal(whole, pieces) and whole.count_nonzero() > 0
    with pytest.raises(ValueError, match="multiple of the chunk"):
        codec.decode_add_(payload, pieces, 3)


@pytest.mark.parametrize("divisor", [127, 7, 3, 1])
def test_scales_are_divided_correctly_rounded(divisor):
    """A chunk's scale is one correctly rounded quotient (numpy's), not a product with the
    reciprocal, which CUDA substitutes for a division by a host number and which rounds the
    other way on some values (4.5% of them for 127, 54% for 7 on an H200)."""
    x = torch.rand(1 << 16, generator=torch.Generator().manual_seed(3)) * 10
    want = torch.from_numpy(x.numpy() / np.float32(divisor))
    assert torch.equal(codec_base.divide_(x.clone(), divisor), want)
    if divisor in (127, 7):  # the product form is told apart by this comparison
        assert not torch.equal(x * (1 / torch.tensor(float(divisor))), want)


def test_random_positions_come_from_the_seed_in_the_payload():
    codec = RandomK(1)
    a, b = torch.randn(4 * CHUNK), torch.zeros(4 * CHUNK)
    kept = []
    for seed in (1, 2, 1):
        payload = torch.empty(codec.nbytes(a.numel()), dtype=torch.uint8)
        codec.encode_(a, b, payload, seed=seed)
        out = torch.zeros_like(a)
        RandomK(1).decode_add_(payload, out)  # another holder: nothing but the payload
        kept.append(out != 0)
        assert int(kept[-1].view(4, CHUNK).sum(1).max()) == 10  # 1% of 1024, per chunk
    assert torch.equal(kept[0], kept[2]) and not torch.equal(kept[0], kept[1])
    # without a seed, a counter: every encode draws anew
    p1, p2 = (torch.empty(codec.nbytes(a.numel()), dtype=torch.uint8) for _ in range(2))
    codec.encode_(a, b, p1)
    codec.encode_(a, b, p2)
    assert not torch.equal(p1[:8], p2[:8])


@pytest.mark.parametrize(
    "name, cls, spec",
    [
        ("int4", Quantized, Spec("all", 100.0, 4)),
        ("int2", Quantized, Spec("all", 100.0, 2)),
        ("rand1%", RandomK, Spec("rand", 1.0, 32)),
        ("top0.5%", TopK, Spec("top", 0.5, 32)),
        ("rand10%+int4", RandomK, Spec("rand", 10.0, 4)),
        ("top1%+int2", TopK, Spec("top", 1.0, 2)),
        ("top10%+int8", TopK, Spec("top", 10.0, 8)),
    ],
)
def test_names_make_the_documented_codec(name, cls, spec):
    codec = codecs.get(name)
    assert type(codec) is cls and codec.spec == spec and codec.name == name
    assert codecs.get(codec) is codec  # an object passes through
    per = _hand_nbytes(
        spec.keep, spec.percent, None if spec.bits == 32 else spec.bits, CHUNK, CHUNK
    )
    per -= 8 if spec.keep == "rand" else 0
    assert codec.bytes_per_element == per / CHUNK
    assert runtime.wire_bytes(4.0 * CHUNK, name) == pytest.approx(per)


@pytest.mark.parametrize(
    "bad", ["int3", "rand0%", "top101%", "rand1", "top1%+int3", "1%", "rand1%+"]
)
def test_bad_names_are_refused_with_the_grammar(bad):
    with pytest.raises(ValueError, match=r"rand<p>%"):
        codecs.get(bad)
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"top<p>%"):
        dopt.DSGD([p], lr=0.1, compression=bad)


def test_bad_arguments_of_the_classes_are_refused():
    with pytest.raises(ValueError, match="bits must be 4 or 2"):
        Quantized(8)
    with pytest.raises(ValueError, match="percent"):
        TopK(0)
    with pytest.raises(ValueError, match="bits"):
        RandomK(1, bits=3)
    with pytest.raises(ValueError, match="chunk must divide"):
        TopK(1, chunk=1000)
    for bad in (0, 1.5, True, "0.1"):
        with pytest.raises(ValueError, match=r"gamma must be None .* in \(0, 1\]"):
            TopK(1, bits=2, gamma=bad)


GAMMAS = {  # docs/algorithms.rst: min(c k/C, g), c = 1/2 (rand), 2 (top); g = 0.2 for int2
    "bf16": 1.0,
    "int8": 1.0,
    "int4": 1.0,
    "int2": 0.2,
    "rand1%": 0.5 * 10 / 1024,
    "top1%": 2 * 10 / 1024,
    "rand1%+int4": 0.5 * 10 / 1024,
    "top1%+int2": 2 * 10 / 1024,
    "top10%+int8": 2 * 102 / 1024,
}


@pytest.mark.parametrize("name", sorted(GAMMAS))
def test_consensus_steps(name):
    assert codecs.get(name).gamma == pytest.approx(GAMMAS[name], rel=1e-12)


def test_nonfinite_kept_values_are_seen_in_the_payload():
    for name in NAMES:
        codec = codecs.get(name)
        a = torch.randn(2 * CHUNK)
        a[5] = float("nan") if name.startswith("top") else a[5]
        a[CHUNK:] = float("inf")  # a whole chunk: whatever is kept is inf
        payload = torch.empty(codec.nbytes(a.numel()), dtype=torch.uint8)
        codec.encode_(a, torch.zeros_like(a), payload, seed=0)
        assert bool(codec.nonfinite(payload)), name


# -- gloo ranks: the dense float64 simulation with the reference codec ----------------------------
def _shards(numel: int, width: int) -> list[tuple[int, int]]:
    size = math.ceil(math.ceil(numel / width) / CHUNK) * CHUNK  # whole chunks per member
    return [(min(k * size, numel), min((k + 1) * size, numel)) for k in range(width)]


def _simulate(
    name: str, topology: str, n: int, local: int, x: torch.Tensor, rounds: int, gamma=None
):
    """x (ranks, numel) after each of ``rounds`` compressed gossip rounds (round 0 not run);
    ``gamma``: the consensus step, if not the codec's own. Every public copy starts from the
    values the ranks were built with, :func:`_common` (the start-up broadcast gave every rank
    those; the ranks then write their own), so the first round already sends compressed
    differences."""
    broadcast = _common()
    codec = codecs.get(name)
    gamma = codec.gamma if gamma is None else gamma
    keep, percent, bits = codec.spec.keep, codec.spec.percent, codec.spec.bits
    bits = None if bits == 32 else bits
    topo = get_topology(topology, n, local)
    copies: dict[tuple[int, ...], list[torch.Tensor]] = {}
    history = []
    for t in range(1, rounds + 1):
        new = x.clone()
        for group in topo.groups(t):
            nodes = sorted({i // local for i in group})
            if len(nodes) == 1:
                new[list(group)] = x[list(group)].mean(0)
                continue
            parts = [[i for i in group if i // local == node] for node in nodes]
            means = [x[p].mean(0) for p in parts]
            held = copies.setdefault(group, [broadcast.clone() for _ in parts])
            for a, m in enumerate(means):
                for lo, hi in _shards(x.shape[1], len(parts[0])):
                    q = reference(
                        keep, percent, bits, CHUNK, m[lo:hi], held[a][lo:hi], (t << 36) + a
                    )
                    held[a][lo:hi] += q
            for a, part in enumerate(parts):
                pull = sum(held[b] - held[a] for b in range(len(parts)) if b != a)
                new[part] = means[a] + gamma / len(parts) * pull
        x = new
        history.append(x.clone())
    return torch.stack(history, 1)


def _common() -> torch.Tensor:
    """The values every rank is built with (so the start-up broadcast gives these)."""
    gen = torch.Generator().manual_seed(99)
    return torch.randn(NUMEL, generator=gen, dtype=torch.float64) * torch.logspace(-2, 2, NUMEL)


def _start(n: int) -> torch.Tensor:
    """Each rank's own values, written after the optimizer is built: the common start moved
    apart by a tenth of its scale, as ranks drift apart in training."""
    rows = []
    for rank in range(n):
        gen = torch.Generator().manual_seed(rank)
        drift = torch.randn(NUMEL, generator=gen, dtype=torch.float64) * torch.logspace(
            -2, 2, NUMEL
        )
        rows.append(_common() + 0.1 * drift)
    return torch.stack(rows)


def _gossip_alone(rank, n, topology, local, compression, rounds):
    """lr = 0: every step is one round of mixing; returns the values after each, and the bytes."""
    x = torch.nn.Parameter(_common())
    opt = dopt.DSGD([x], lr=0.0, topology=topology, local_world_size=local, compression=compression)
    with torch.no_grad():
        x.copy_(
            _start(n)[rank]
        )  # each rank its own values (the start-up broadcast made them equal)
    history, sent = [], []
    for _ in range(rounds):
        x.grad = torch.zeros_like(x)
        opt.step()
        history.append(x.detach().clone())
        sent.append(opt.bytes_sent)
    return torch.stack(history), sent


CASES = [("ring", 4, 1), ("complete", 4, 2), ("ring", 4, 2)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("topology, n, local", CASES, ids=str)
def test_rounds_match_the_dense_reference_keep_the_mean_and_reach_consensus(
    topology, n, local, name
):
    rounds = 24
    results = run_world(_gossip_alone, n, topology, local, name, rounds)
    got = torch.stack([h for h, _ in results])  # (ranks, rounds, numel)
    # step t mixes round t (launched by step t - 1): step 0 mixes nothing
    want = _simulate(name, topology, n, local, _start(n), rounds - 1)
    torch.testing.assert_close(got[:, 1:], want, rtol=0, atol=1e-9)
    mean = got.mean(0)
    scale = _start(n).abs().max()
    torch.testing.assert_close(mean, mean[:1].expand_as(mean), rtol=0, atol=1e-13 * scale)
    spread = (got - mean).norm(dim=(0, 2))
    # the consensus distance falls, round after round. Slowly for random-k: its step is k / 2C,
    # and its public copies start from the common start and take in 1% of a difference a round,
    # so they need about C / k rounds to see the ranks' own values (an exact first round would
    # cost the bytes of 455 rounds of rand1%+int4); in the 2 x 2 ring every other round is
    # inside the nodes, whose members already agree
    if name.startswith("rand"):
        assert spread[-1] < spread[0] and (spread[4:].diff() <= 0).all(), spread
    else:
        assert spread[-1] < 0.95 * spread[0] and (spread[4:].diff() < 0).all(), spread


@pytest.mark.multiprocess
def test_a_consensus_step_of_the_users_is_the_one_mixed_with():
    """TopK(1, bits=2, gamma=0.1): five times the codec's own step, in the ranks' rounds as in
    the dense reference; its repr says so (start-up compares it across ranks)."""
    codec = TopK(1, bits=2, gamma=0.1)
    assert (
        repr(codec) == "TopK('top1%+int2', gamma=0.1)" and repr(TopK(1, 2)) == "TopK('top1%+int2')"
    )
    rounds = 12
    results = run_world(_gossip_alone, 4, "ring", 1, codec, rounds)
    got = torch.stack([h for h, _ in results])
    want = _simulate("top1%+int2", "ring", 4, 1, _start(4), rounds - 1, gamma=0.1)
    torch.testing.assert_close(got[:, 1:], want, rtol=0, atol=1e-9)
    own = _simulate("top1%+int2", "ring", 4, 1, _start(4), rounds - 1)
    assert (own - want).abs().max() > 1e-3  # the test would pass with the codec's own step


# -- bytes on the wire ---------------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "topology, n, local, compression",
    [
        ("ring", 4, 1, None),
        ("complete", 4, 1, None),
        ("ring", 4, 1, "rand1%+int4"),
        ("complete", 4, 2, "top1%+int2"),
        ("complete", 4, 2, None),
    ],
    ids=str,
)
def test_bytes_sent_are_the_payloads(topology, n, local, compression):
    steps = 6
    results = run_world(_gossip_alone, n, topology, local, compression, steps)
    full = NUMEL * 8  # float64
    for rank, (_, sent) in enumerate(results):
        # step t launches round t + 1; a sparse codec's public copies start from the broadcast
        # start values, so its first round sends a payload too (bf16 and int8 send exact values)
        if topology == "ring" and compression is None:  # one peer per round, point to point
            per_round = [full] * steps
        elif topology == "complete" and local == 1:  # a ring all-reduce over 4
            per_round = [2 * 3 * full // 4] * steps
        elif topology == "ring":  # two groups per rank (pairs), 35 bytes each round
            payload = 8 + 3 * 4 + 3 * math.ceil(10 * 4 / 8)
            assert codecs.get(compression).nbytes(NUMEL) == payload
            per_round = [payload] * steps
        else:  # 2 x 2: the partner's shard out and the own shard's payload across at the
            # launch; the mixed own shard back to the partner at the mix, in the next step
            own, other = (2048, 952) if rank % 2 == 0 else (952, 2048)
            payload = own * 8 if compression is None else math.ceil(own / CHUNK) * (4 + 20 + 3)
            later = other * 8 + payload + own * 8
            first = other * 8 + (own * 8 if compression is None else payload)
            per_round = [first] + [later] * (steps - 1)
        assert sent == list(np.cumsum(per_round)), (rank, sent)


# -- the plan: which codec keeps a round hidden at R ----------------------------------------------
def test_plan_names_the_codec_whose_round_crosses_in_time(capsys, monkeypatch):
    from decent_optim import plan

    monkeypatch.delenv("RANK", raising=False)  # the table alone needs no launcher
    assert plan.main(["--r", "30", "--local-steps", "8"]) == 0
    out = capsys.readouterr().out
    # per element: top1%+int8 (4 + 2 * 10 + 10) / 1024 bytes, 30 * that / 4 = 0.249 steps, the
    # most bytes under 1 step (top10%+int4: (4 + 204 + 51) / 1024 -> 1.90, int2 1.90); int8
    # 30 * (1 + 4 / 1024) / 4 = 7.53 steps under 8, bf16 15
    assert "local_steps=1: compression='top1%+int8' keeps a round hidden" in out
    assert "local_steps=8: compression='int8' keeps a round hidden" in out
    assert plan.main(["--r", "1000", "--compression", "int8"]) == 0
    assert "local_steps=1: no round is hidden" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["bf16", "int8", *NAMES])
def test_the_slice_length_changes_no_bit(name, monkeypatch):
    """A GPU works the buffers in larger slices than a CPU (codec_base.SLICE_BY_DEVICE); the
    chunks are the same, so payload, absorbed copy and decoded sum are the same bits."""
    from decent_optim.gossip import codec_base

    gen = torch.Generator().manual_seed(3)
    a = torch.randn(5 * CHUNK + 77, generator=gen)
    b = a + 0.1 * torch.randn(a.numel(), generator=gen)

    def one_round(slice_elements: int):
        monkeypatch.setitem(codec_base.SLICE_BY_DEVICE, "cpu", slice_elements)
        codec = codecs.get(name)
        payload = torch.empty(codec.nbytes(a.numel()), dtype=torch.uint8)
        public = b.clone()
        codec.encode_(a, public, payload, absorb=True, seed=11)
        out = torch.zeros_like(a)
        codec.decode_add_(payload, out)
        return payload, public, out

    small, large = one_round(CHUNK), one_round(1 << 24)
    assert codec_base.slice_len(torch.device("cuda")) == 1 << 24
    for x, y in zip(small, large):
        assert torch.equal(x, y)

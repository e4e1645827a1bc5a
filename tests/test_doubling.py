"""``local_steps=DoublingPeriods(H, after=W)`` (decent_optim.optim.doubling): periods of ``H``
steps up to ``W``, then of ``2H``, against a dense float64 reference on 4 gloo ranks."""

from __future__ import annotations

import _live
import pytest
import torch
from _harness import run_world

STEPS, H, AFTER = 16, 2, 4


def test_the_periods_end_where_they_should():
    from decent_optim.optim.doubling import DoublingPeriods

    p = DoublingPeriods(2, after=4)
    assert [c for c in range(1, 17) if p.ends(c)] == [2, 4, 8, 12, 16]
    assert [p.index(c) for c in (0, 1, 2, 4, 5, 7, 8, 12, 16)] == [0, 0, 1, 2, 2, 2, 3, 4, 5]
    assert [p.start(c) for c in (1, 3, 4, 5, 7, 8, 9)] == [0, 2, 4, 4, 4, 8, 8]
    for bad in (dict(after=3), dict(after=-2)):
        with pytest.raises(ValueError, match="multiple of local_steps=2"):
            DoublingPeriods(2, **bad)


def test_refused_with_uneven():
    from decent_optim import DecentralizedAdamW
    from decent_optim.optim.doubling import DoublingPeriods

    with pytest.raises(ValueError, match="uneven=True takes local_steps=an int"):
        DecentralizedAdamW(
            _live.model().parameters(), local_steps=DoublingPeriods(2, after=4), uneven=True
        )


def _train(rank, world_size):
    from decent_optim import DecentralizedAdamW
    from decent_optim.optim.doubling import DoublingPeriods

    model = _live.model()
    opt = DecentralizedAdamW(
        model.parameters(),
        lr=_live.LR,
        topology="ring",
        local_world_size=1,
        local_steps=DoublingPeriods(H, after=AFTER),
    )
    rounds = []
    for t in range(STEPS):
        _live.loss(model, rank, t).backward()
        opt.step()
        opt.zero_grad()
        rounds.append(opt.round)
    return _live.flat(model.parameters()), rounds


def _reference():
    """The ranks without the package: torch.optim.AdamW on each one's gradients; at the end of
    the periods (2, 4, 8, 12, 16) the anchors are launched, and mixed by the ring at the next."""
    from decent_optim import topologies

    ends = [2, 4, 8, 12, 16]
    net = _live.model()
    x0 = torch.nn.utils.parameters_to_vector(net.parameters()).detach()
    xs = [torch.nn.Parameter(x0.clone()) for _ in range(4)]
    opts = [torch.optim.AdamW([x], lr=_live.LR, foreach=False) for x in xs]
    anchors, pending = [x0.clone() for _ in range(4)], None
    for c in range(STEPS):
        grads = []
        for i, x in enumerate(xs):
            torch.nn.utils.vector_to_parameters(x.detach().clone(), net.parameters())
            net.zero_grad()
            _live.loss(net, i, c).backward()
            grads.append(torch.cat([q.grad.reshape(-1) for q in net.parameters()]))
        if c + 1 in ends and pending is not None:
            w = topologies.get("ring", 4).mixing_matrix(pending).double()
            mixed = w @ torch.stack(anchors)
            with torch.no_grad():
                for i, x in enumerate(xs):
                    x.add_(mixed[i] - anchors[i])
            anchors, pending = list(mixed), None
        for x, g, opt in zip(xs, grads, opts):
            x.grad = g
            opt.step()
        if c + 1 in ends:
            anchors, pending = [x.detach().clone() for x in xs], ends.index(c + 1) + 1
    return [x.detach() for x in xs]


@pytest.mark.multiprocess
def test_doubling_periods_are_the_dense_reference():
    results = run_world(_train, 4)
    for (got, rounds), want in zip(results, _reference()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
        # rounds completed: one per period, 2 steps each up to step 4, then 4 each
        assert rounds == [0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5], rounds

"""The model, data and dense float64 reference that the tests of live membership share.

Test files import it by its top-level name, as ``_harness`` (``tests/conftest.py`` puts ``tests/``
on ``sys.path``). Each rank trains a float64 ``Linear(3, 2)`` on data drawn from its member id
and step (:func:`loss`); :func:`simulate` replays the ranks after a change of membership --
survivors after a loss (test_live_optimizer) or members and a newcomer after a join
(test_live_join) -- without the package.
"""

from __future__ import annotations

import torch

from decent_optim import topologies

STEPS, LR = 16, 0.05


def loss(model, member, t):
    gen = torch.Generator().manual_seed(1000 * member + t)
    x = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    y = torch.randn(5, 2, generator=gen, dtype=torch.float64)
    return torch.nn.functional.mse_loss(model(x), y)


def model(seed=0, width=2):
    torch.manual_seed(seed)
    return torch.nn.Linear(3, width).double()


def ring(params, compression, membership=None, sgd=False, timeout=30.0):
    """The optimizer of the compression and checkpoint tests: ``DecentralizedAdamW`` (or
    ``DSGD``) on the ring, every rank a node of its own, so that every pair is compressed."""
    from decent_optim import DSGD, DecentralizedAdamW

    make = DSGD if sgd else DecentralizedAdamW
    return make(
        params,
        lr=LR,
        topology="ring",
        timeout=timeout,
        local_world_size=1,
        compression=compression,
        membership=membership,
    )


def train(model, opt, member, start, stop=STEPS):
    """Steps ``start`` to ``stop - 1`` on ``member``'s data."""
    for t in range(start, stop):
        loss(model, member, t).backward()
        opt.step()
        opt.zero_grad()


def flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors]).clone()


def simulate(starts, members, local_steps, mix=None):
    """The ranks from their states at a change of membership (``starts``: each one's ``x``,
    Adam's ``m``, ``v`` and ``step``, and its ``count``), in float64: rounds of the ring on
    ``len(members)`` ranks from the largest count on, ``torch.optim.AdamW`` on each one's own
    gradients (``members``: the data each one draws). A rank whose count is lower takes its
    steps up to the largest without gossip. ``mix(k, sent)``, if given, replaces round ``k``'s
    mixing matrix: it returns what each rank holds after the round (compressed gossip)."""
    topo = topologies.get("ring", len(members))
    resume = max(s["count"] for s in starts)
    net = model()
    rows, opts = [], []
    for s in starts:
        p = torch.nn.Parameter(s["x"].clone())
        opt = torch.optim.AdamW([p], lr=LR, foreach=False)
        opt.state[p] = {
            "step": torch.tensor(float(s["step"]), dtype=torch.float64),
            "exp_avg": s["m"].clone(),
            "exp_avg_sq": s["v"].clone(),
        }
        rows.append(p)
        opts.append(opt)
    anchors = [p.detach().clone() for p in rows]  # what each sent last (local_steps > 1)
    for t in range(min(s["count"] for s in starts), STEPS):
        active = [s["count"] <= t for s in starts]
        grads = []
        for p, member in zip(rows, members):
            torch.nn.utils.vector_to_parameters(p.detach().clone(), net.parameters())
            net.zero_grad()
            loss(net, member, t).backward()
            grads.append(flat(q.grad for q in net.parameters()))
        launched = t + 1 - local_steps  # round k is launched at count kH >= resume
        if (t + 1) % local_steps == 0 and launched >= resume:
            assert all(active)
            sent = torch.stack(anchors)
            if mix is None:
                mixed = topo.mixing_matrix(launched // local_steps).double() @ sent
            else:
                mixed = torch.stack(mix(launched // local_steps, list(sent)))
            with torch.no_grad():
                for i, p in enumerate(rows):
                    p.add_(mixed[i] - sent[i])
        for i, (p, opt) in enumerate(zip(rows, opts)):
            if active[i]:
                p.grad = grads[i]
                opt.step()
                if (t + 1) % local_steps == 0:
                    anchors[i] = p.detach().clone()
    return [p.detach() for p in rows]

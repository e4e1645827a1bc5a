r"""Step 3 of compressed gossip (:mod:`~decent_optim.gossip.compressed`) on one shard.

A member of part :math:`a` of :math:`p` parts holds every part's public copy :math:`\hat x_b` of
its shard. It adds the other parts' payloads :math:`q_b` to their copies (every holder adds the
same payloads, so the copies stay equal on every holder) and writes

.. math::
    x_i \leftarrow m_a + \frac{\gamma}{p} \sum_{b \ne a} (\hat x_b - \hat x_a)

a slice at a time (:func:`~decent_optim.gossip.codecs.slice_len`), so that the scratch stays
small and the copies are read once per round.
"""

from __future__ import annotations

import torch
from torch import Tensor

from decent_optim.gossip.codecs import Codec, slice_len

__all__ = ["mix_shard_"]


def mix_shard_(
    x: Tensor,
    m: Tensor,
    copies: list[Tensor],
    mine: int,
    payloads: list[Tensor] | None,
    codec: Codec,
    acc: Tensor,
) -> None:
    """Step 3 of the module docstring for one shard: update the copies, then write ``x``.

    Args:
        x: this rank's shard of the buffer, written with the mix.
        m: its part's mean of the shard (``x`` itself for parts of one rank).
        copies: every part's public copy of the shard, in part order; ``copies[mine]``, the own,
            already holds this round's value (the encoder absorbed its payload).
        payloads: the other parts' payloads, in part order; None for a round of exact values,
            whose copies already hold what was received.
        acc: scratch of ``min(slice_len(x.device), x.numel())`` elements.
    """
    own = copies[mine]
    others = [c for a, c in enumerate(copies) if a != mine]
    alpha = codec.gamma / len(copies)
    step = slice_len(x.device)
    for lo in range(0, x.numel(), step):
        hi = min(lo + step, x.numel())
        if payloads is not None:  # every holder adds the same payload to a copy: they stay equal
            for payload, copy in zip(payloads, others):
                codec.decode_add_(payload, copy, lo, hi)
        a = acc[: hi - lo]
        torch.sub(others[0][lo:hi], own[lo:hi], out=a)
        for copy in others[1:]:
            a.add_(copy[lo:hi]).sub_(own[lo:hi])
        if m is x:
            x[lo:hi].add_(a, alpha=alpha)
        else:
            torch.add(m[lo:hi], a, alpha=alpha, out=x[lo:hi])

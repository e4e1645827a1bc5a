"""The loop ranks of uneven speed must write, and the checks that send users to it.

With ``uneven=True`` (:mod:`~decent_optim.optim.uneven`) the ranks take different numbers of
steps, so everything that every rank must do at the same point -- stop, evaluate, save, call a
collective -- goes at a *round* (``opt.round``), never at a step count. :data:`LOOP` is that loop
in words, for the errors that refuse other loops; :data:`HINT` is what a failed round says
usually causes it in this mode; :func:`check_same_round` compares the ranks' rounds before a
collective, so that one called at different rounds is an error on every rank instead of a
collective matched with the wrong one (or a hang).
"""

from __future__ import annotations

from typing import Any

from decent_optim.gossip.collectives import comm_device
from decent_optim.optim.agreement import Account, agree

__all__ = ["HINT", "LOOP", "check_same_round"]

#: the loop uneven ranks need, for the errors that send users to it
LOOP = (
    "opt.stop_at(total_steps) before the loop, then `while not opt.stopped: ... opt.step()`, "
    "with collectives (opt.averaged(), checkpoints) at rounds: `if opt.round % k == 0 and "
    "opt.round != last:` (see docs/uneven_hardware)"
)

#: what usually stops a neighbour's rounds in this mode (GossipError's hint)
HINT = (
    "With uneven=True a peer also stops sending rounds when it left its training loop before "
    "opt.stopped turned true (a `for step in range(N)` loop: ranks take different numbers of "
    "steps, an early `break`), stopped at another budget, or waits in a collective that it "
    "called at another round. Every rank needs the same loop: " + LOOP
)


def check_same_round(gossip: Any, round: int, what: str) -> None:
    """Raise the same :class:`~decent_optim.optim.agreement.AgreementError` on every rank of
    ``gossip``'s group if they reached the collective ``what`` at different rounds (one small
    all-gather, bounded by the gossip's timeout; nothing in a world of one)."""
    group = getattr(gossip, "group", None)
    if group is None:
        return
    account = Account(settings=[("the round", f"opt.round {round}")])
    hint = (
        "With uneven=True ranks reach the same step count at different rounds, so "
        f"collectives go at rounds, not at step counts (`t % k == 0`): {LOOP}"
    )
    timeout = getattr(gossip, "timeout", None)
    agree(account, group, comm_device(group), what, hints={"the round": hint}, timeout=timeout)

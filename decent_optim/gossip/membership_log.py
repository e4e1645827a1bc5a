"""What a change of membership tells the log (logger ``decent_optim.gossip.membership``), on
every member, whether or not the optimizer was given ``on_membership_change=``.

A loss is a ``WARNING``, which Python prints to standard error even where the program set no
logging up (the "last resort" handler): the survivors of a lost worker say so in their own
output. A join that loses nobody is ``INFO``.
"""

from __future__ import annotations

import logging

from decent_optim.gossip.view import View

__all__ = ["log_change"]

_log = logging.getLogger("decent_optim.gossip.membership")


def log_change(old: View, new: View, me: int) -> None:
    """Log the change from ``old`` (generation -1: a newcomer's) to ``new`` on member ``me``."""
    joined = sorted(set(new.members) - set(old.members))
    if old.generation < 0:
        what = f"this process joined the job as id {me}"
    else:
        lost = f"lost id(s) {list(new.lost)}" if new.lost else "lost none"
        what = f"{lost}, took in id(s) {joined}" if joined else lost
    _log.log(
        logging.WARNING if new.lost else logging.INFO,
        "live membership, generation %d: %s; now %d member(s) %s, this one rank %d (id %d)",
        new.generation,
        what,
        new.world_size,
        list(new.members),
        new.rank,
        me,
    )

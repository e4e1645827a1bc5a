"""What a failed wait for a round or a collective says: :class:`GossipError` and its message.

A transport error is one of three things, and each has its own cause to look for: the peer's end
of the connection closed (its process is gone: :func:`connection_closed`), the wait ran into the
deadline (a peer never took part: a slow or stalled rank, or one busy in work the others do not
do), or the transport failed otherwise. :func:`explain` words the message for
:class:`~decent_optim.gossip.handle.GossipHandle`, naming the round, the peers and the seconds
waited.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

__all__ = ["PEER_GONE_HINT", "GossipError", "connection_closed", "explain", "timed_out"]


class GossipError(RuntimeError):
    """A gossip round could not complete: a peer died, stopped stepping, or timed out."""

    #: the group ranks the failure points at: the peer whose connection closed, or the peers a
    #: timed-out wait was still waiting for; empty when it cannot tell (live membership's
    #: suspects, :meth:`~decent_optim.gossip.membership.Membership.rebuild`)
    peers: tuple[int, ...] = ()


#: what the transports say when the other end of a connection went away: gloo's "Connection
#: closed by peer" (an orderly close, e.g. the process exited), "Connection reset by peer" (the
#: kernel reset it, e.g. the process was killed), "Socket closed"; NCCL's "remote process exited"
_CLOSED = (
    "connection closed",
    "connection reset",
    "socket closed",
    "broken pipe",
    "remote process exited",
)

#: a wait that failed this close to its deadline timed out: the transports end a wait a little
#: early (gloo's "Operation timed out!" after 1.99x s of a 2 s wait)
_SLACK_S = 0.1

#: what to do about a peer whose process is gone
PEER_GONE_HINT = (
    "Look for the first error in that peer's log (a traceback, an out-of-memory kill); the "
    "ranks are now out of step: restart the job, or resume every rank from a checkpoint "
    "(torchrun --max-restarts with decent_optim.checkpoint, see docs/surviving_failures)"
)

#: what usually keeps a live peer away from a round
_ABSENT_HINT = (
    "A peer may have died, called "
    "step() fewer times than this rank (every rank must call step() once per iteration), "
    "or be busy in work that only some ranks do, such as evaluation or checkpointing "
    "under `if rank == 0:`. Evaluate on every rank inside opt.averaged(model), or call "
    "opt.synchronize() and a barrier around rank-only work, or pass a longer timeout= "
    '(see "Rank-only work" in docs/training_loops)'
)


def connection_closed(err: BaseException) -> bool:
    """Whether a transport error says the peer's end of the connection closed."""
    text = str(err).lower()
    return any(phrase in text for phrase in _CLOSED)


def timed_out(err: BaseException) -> bool:
    """Whether a transport error is a timeout of its own (gloo: "Timed out waiting 2999ms")."""
    return "timed out" in str(err).lower() or "timeout" in type(err).__name__.lower()


def explain(
    where: str,
    err: Exception,
    *,
    waiting: list[int],
    failed: int | None,
    group_peers: list[int],
    start: float,
    deadline: float | None,
    timeout: datetime.timedelta | None,
    late: Callable[[], list[int]] | None,
    hint: str | None,
) -> str:
    """The message of a wait (``where``: "[rank r] what") that failed with ``err``.

    ``waiting``: the peers of the transfers not completed; ``failed``: the peer of the one that
    failed (None: a group collective, whose other ranks are ``group_peers``); ``start`` and
    ``deadline``: the wait's, on :func:`time.monotonic`; ``late``: which ranks of a group never
    reached the collective (see gossip.arrival); ``hint``: what usually causes a failure there,
    instead of the default (a rank busy alone included).
    """
    waited = time.monotonic() - start
    if connection_closed(err):
        # a transport error, not a timeout: say so, or the user hunts for a slow rank
        who = _who([failed] if failed is not None else waiting, group_peers)
        what = (
            f"the connection to {who} closed after {waited:.1f} s of waiting: the other "
            "end's process is gone (it crashed, was killed, or exited) or it shut its "
            "process group down (after an error of its own)"
        )
        # the context's hint still applies: the other end may have failed for that reason
        gone = PEER_GONE_HINT if hint is None else f"{hint}. {PEER_GONE_HINT}"
        return f"{where}: {what}. {gone}. Cause: {err}"
    who = _who(waiting, group_peers)
    missing = late() if late is not None else []
    if missing:  # the others arrived: the late ones are the ones to look at
        limit = "" if timeout is None else f" (timeout {timeout.total_seconds():g} s)"
        what = (
            f"rank(s) {missing} of its group never reached it{limit}; the others did; "
            f"waited {waited:.1f} s"
        )
    elif deadline is not None and time.monotonic() >= deadline - _SLACK_S:
        assert timeout is not None
        limit = f"timeout {timeout.total_seconds():g} s"
        what = f"{who} did not take part in it within the timeout ({limit}); waited {waited:.1f} s"
    elif timed_out(err):  # the process group's own timeout, shorter than ours or alone
        what = (
            f"{who} did not take part in it within the process group's timeout (waited "
            f"{waited:.1f} s)"
        )
    else:
        before = "" if timeout is None else f", before the {timeout.total_seconds():g} s timeout"
        what = f"waiting on {who} failed after {waited:.1f} s{before}"
    return f"{where}: {what}. {hint or _ABSENT_HINT}. Cause: {err}"


def _who(peers: list[int], group_peers: list[int]) -> str:
    if peers:
        return f"peer(s) {peers}"
    if group_peers:
        return f"its group (the other rank(s): {group_peers})"
    return "its gossip group"

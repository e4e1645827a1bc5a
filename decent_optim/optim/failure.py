"""After a gossip failure the optimizer stays failed: every later call raises the same error.

A :class:`~decent_optim.gossip.GossipError` (a peer died, stopped stepping or timed out) leaves
the ranks out of step: a round half sent, a collective half joined. Going on would wait on
transfers that never come and end, after the process group's timeout, in a raw transport error
("Connection reset by peer") that no longer names the round or the peer. So the first such error
is kept (:class:`FailureLatch`), and every later call that would communicate -- ``step()``,
``synchronize()``, ``averaged()``, ``consensus_distance()``, ``load_state_dict()`` -- raises a
``GossipError`` with its message at once, without touching the process group.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from decent_optim.gossip import GossipError

__all__ = ["FailureLatch", "guarded", "guarded_block"]

F = TypeVar("F", bound=Callable[..., Any])


class FailureLatch:
    """The first gossip failure of one optimizer (``owner`` names it in messages)."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.failure: GossipError | None = None

    def check(self) -> None:
        """Raise again the failure seen earlier, if there was one."""
        if self.failure is not None:
            raise GossipError(
                f"{self.owner} cannot continue after an earlier gossip failure (the ranks are "
                f"out of step; restart the job, or resume every rank from a checkpoint): "
                f"{self.failure}"
            ) from self.failure

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Check, then remember a ``GossipError`` raised in the block."""
        self.check()
        try:
            yield
        except GossipError as err:
            self.failure = err
            raise


def guarded(method: F) -> F:
    """Run an optimizer method under its ``_latch`` (:meth:`FailureLatch.guard`)."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._latch.guard():
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


@contextlib.contextmanager
def guarded_block(
    latch: FailureLatch, block: contextlib.AbstractContextManager[None]
) -> Iterator[None]:
    """``block``, whose entry (where it communicates) runs under ``latch``."""
    with contextlib.ExitStack() as stack:
        with latch.guard():
            stack.enter_context(block)
        yield

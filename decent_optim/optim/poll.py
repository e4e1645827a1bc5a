"""How long an uneven rank waits for a round (:class:`Poll`): not at all, until a cap.

A round's transfers are waited for in a thread of their own, so that a step can ask whether they
are done without waiting (gloo's point-to-point works say they are complete only once waited
for). The wait is bounded by the optimizer's ``timeout``; an error is handed to the step. After
``longest`` steps since the launch (``Uneven(cap=...)``) the step waits for the thread.
"""

from __future__ import annotations

import threading

from decent_optim.gossip import GossipHandle

__all__ = ["Poll"]


class Poll:
    """How long a rank waits for a round: not at all (a thread waits, :meth:`ready` asks it),
    until it took ``longest`` steps since the launch (None: never)."""

    def __init__(self, longest: int | None) -> None:
        self.longest = longest
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def watch(self, handles: list[GossipHandle]) -> None:
        """Wait for ``handles`` in a thread of their own (none: nothing to wait for)."""
        self.done, self.error, self.thread = threading.Event(), None, None
        if handles:
            self.thread = threading.Thread(target=self._run, args=(handles,), daemon=True)
            self.thread.start()

    def _run(self, handles: list[GossipHandle]) -> None:
        try:
            for handle in handles:
                handle.wait()  # bounded by the optimizer's timeout (GossipError)
        except BaseException as err:  # handed to the step, which raises it
            self.error = err
        finally:
            self.done.set()

    def ready(self, since: int) -> bool:
        """Whether to mix now, at ``since`` steps after the launch: arrived, or capped."""
        capped = self.longest is not None and since >= self.longest - 1
        return capped or self.thread is None or self.done.is_set()

    def finish(self) -> BaseException | None:
        """Wait for the thread (at most the timeout): the round's error, if it failed."""
        thread, self.thread = self.thread, None
        if thread is None:
            return None
        thread.join()
        return self.error

    def join(self) -> None:
        """Let the round's transfers finish (the thread owns the wait)."""
        if self.thread is not None:
            self.thread.join()

    def forget(self) -> None:
        self.thread = None

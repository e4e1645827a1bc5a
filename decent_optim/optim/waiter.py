"""A round's transfers waited for in a thread of its own, so that a step can ask whether they
are done without waiting (gloo's point-to-point works say they are complete only once waited
for). The wait is bounded by the optimizer's ``timeout``; an error is handed to the step."""

from __future__ import annotations

import threading

from decent_optim.gossip import GossipHandle

__all__ = ["Waiter"]


class Waiter:
    """Waits for a round's transfers in a thread of its own; :attr:`done` is set after."""

    def __init__(self, handles: list[GossipHandle]) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
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

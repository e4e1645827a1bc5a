"""Two workers SIGKILLed at once: the seconds from the kills to each survivor's rebuilt step.

    python experiments/live_membership/two_losses.py WORLD VICTIMS [TIMEOUT]
    python experiments/live_membership/two_losses.py 5 1,2 3      # neighbours on the ring of 5
    python experiments/live_membership/two_losses.py 4 0,2 3      # both neighbours of each

gloo ranks of ``tests/_harness.py`` (run from the repository root), ``DecentralizedAdamW`` on
the ring with the float64 model of ``tests/_live.py``, ``Membership(timeout=TIMEOUT)`` on a
``FileStore``; the victims kill themselves before step 4. Prints, per survivor, the step at which
its group changed, the seconds since the later kill, and the view (docs/surviving_failures,
"Two losses at once cost what one costs": 6.4-8.8 s before the liveness probe, 0.38-0.78 s
after).
"""

import os
import signal
import sys
import tempfile
import time

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "..", "tests")]

import _live  # noqa: E402
from _harness import run_world_fresh  # noqa: E402

KILL_AT = 4


def _train(rank, world_size, path, victims, timeout):
    import torch.distributed as dist

    from decent_optim import DecentralizedAdamW
    from decent_optim.gossip.membership import Membership

    store = dist.FileStore(os.path.join(path, "store"), -1)
    live = Membership(store, prefix="live", timeout=timeout)
    model = _live.model()
    opt = DecentralizedAdamW(
        model.parameters(), lr=_live.LR, topology="ring", timeout=30.0, membership=live
    )
    changes = []
    for t in range(_live.STEPS):
        if t == KILL_AT and rank in victims:
            store.set(f"killed{rank}", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        _live.loss(model, rank, t).backward()
        generation = opt.membership.generation
        opt.step()
        opt.zero_grad()
        if opt.membership.generation != generation:
            changes.append((t, time.time(), tuple(opt.membership)))
    killed = max(float(store.get(f"killed{v}")) for v in victims)
    return [(t, round(at - killed, 2), view) for t, at, view in changes]


def main() -> None:
    world, victims = int(sys.argv[1]), tuple(int(v) for v in sys.argv[2].split(","))
    timeout = float(sys.argv[3]) if len(sys.argv) > 3 else 3.0
    path = tempfile.mkdtemp()
    results = run_world_fresh(_train, world, path, victims, timeout, timeout=120, killed=victims)
    for rank, changes in enumerate(results):
        if changes is not None:
            print(f"rank {rank}: (step, seconds after the kills, view) {changes}")


if __name__ == "__main__":
    main()

"""A worker of tests/test_live_torchrun.py, started by torchrun (one job per "node").

    torchrun --nnodes 1 --nproc-per-node 2 --max-restarts 1 ... _torchrun_worker.py \
        STORE NODES STEPS KILL OUT

Live membership through :func:`decent_optim.gossip.torchrun.membership`; a float32 linear
regression (a fixed teacher plus noise, data drawn from the member id and step), trained with
``DecentralizedAdamW`` on the ring and a linearly decaying learning rate (``reference``: the
same with ``torch.optim.Adam`` on the mean gradient of some members' data, in one process). ``KILL`` is
``ID:STEP``: that member SIGKILLs itself before that step, at its first launch only. Each
process writes ``OUT/<pid>.json``: its id, restarts, whether it joined, the step it started
from, the steps it took, when it started / first stepped in the group / finished, and its
model's loss on held-out data at the end.
"""

import time

STARTED = time.time()  # before the imports: what a restarted worker pays counts

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from decent_optim import DecentralizedAdamW  # noqa: E402
from decent_optim.gossip.torchrun import membership  # noqa: E402

DIM, BATCH, LR, PAUSE = 16, 256, 0.2, 0.25


def batch(member, step, size=BATCH):
    teacher = torch.Generator().manual_seed(0)
    w = torch.randn(DIM, 1, generator=teacher)
    gen = torch.Generator().manual_seed(1_000_003 * member + step)
    x = torch.randn(size, DIM, generator=gen)
    return x, x @ w + 0.1 * torch.randn(size, 1, generator=gen)


def heldout(model):
    with torch.no_grad():
        x, y = batch(-1, 0, 8192)
        return torch.nn.functional.mse_loss(model(x), y).item()


def lr_at(step, steps):
    return LR * (1 - step / steps)


def reference(members, steps):
    """The held-out loss of ``torch.optim.Adam`` on the mean gradient of ``members``' data."""
    torch.manual_seed(0)
    model = torch.nn.Linear(DIM, 1)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps)
        losses = [
            torch.nn.functional.mse_loss(model(x), y)
            for x, y in map(batch, members, [step] * len(members))
        ]
        opt.zero_grad()
        (sum(losses) / len(members)).backward()
        opt.step()
    return heldout(model)


def main():
    store, nodes, steps, kill, out = sys.argv[1:6]
    nodes, steps = int(nodes), int(steps)
    victim, kill_at = (int(v) for v in kill.split(":"))
    live = membership(store, nodes=nodes, prefix="test/torchrun", timeout=4.0)
    joined = live.joining  # a restarted worker: its optimizer joins the running job
    torch.manual_seed(0)
    model = torch.nn.Linear(DIM, 1)
    opt = DecentralizedAdamW(
        model.parameters(), lr=LR, topology="ring", timeout=20.0, membership=live
    )
    view = opt.membership
    me = view.members[view.rank]
    first = int(opt.state[next(model.parameters())]["step"]) if joined else 0
    record = {"id": me, "pid": os.getpid(), "joined": joined, "first": first, "started": STARTED}
    record["restarts"] = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    taken = 0
    for step in range(first, steps):
        if me == victim and step == kill_at and not joined:
            with open(os.path.join(out, "killed"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps)
        time.sleep(PAUSE)  # the rest of a real step's compute
        x, y = batch(me, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        taken += 1
        if taken == 1:
            record["first_step"] = time.time()
    opt.synchronize()
    record.update(steps=taken, finished=time.time(), heldout=heldout(model))
    record["view"] = list(opt.membership)
    dist.destroy_process_group()
    record["destroyed"] = time.time()
    with open(os.path.join(out, f"{os.getpid()}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()

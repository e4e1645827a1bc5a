"""A torchrun worker for ``tests/test_elastic_restarts.py``: two ranks build DSGD and step; in
torchrun's first attempt rank 1 dies at step 2 (``os._exit``), so the agent restarts both.

Prints ``attempt A rank R: finished`` when a rank completes its steps.
"""

import datetime
import os

import torch
import torch.distributed as dist

import decent_optim as dopt


def main() -> None:
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    x = torch.nn.Parameter(torch.zeros(4))
    opt = dopt.DSGD([x], lr=0.1, timeout=10.0)
    for step in range(4):
        if attempt == 0 and rank == 1 and step == 2:
            os._exit(1)  # the fault: the process is gone
        x.grad = torch.full((4,), float(rank + 1))
        opt.step()
    opt.synchronize()
    print(f"attempt {attempt} rank {rank}: finished", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Smallest complete decent_optim script: fit a small MLP to a noisy sine, decentralized.

python examples/quickstart.py [STEPS]                                    # one process
torchrun --standalone --nproc-per-node 4 examples/quickstart.py [STEPS]  # four workers
"""

import os
import sys

import torch
import torch.distributed as dist
from tqdm import tqdm

import decent_optim as dopt

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 300
if "WORLD_SIZE" in os.environ:  # started by torchrun: join the other workers
    dist.init_process_group("gloo")
rank = dist.get_rank() if dist.is_initialized() else 0
torch.set_num_threads(1)

torch.manual_seed(0)  # rank 0's initial model is broadcast to every worker anyway
model = torch.nn.Sequential(torch.nn.Linear(1, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
opt = dopt.DecentralizedAdamW(model.parameters(), lr=1e-2, topology="ring")  # the one change

gen = torch.Generator().manual_seed(rank)  # every worker draws its own data
for step in (bar := tqdm(range(steps), disable=rank != 0)):
    x = torch.rand(32, 1, generator=gen) * 6 - 3
    y = torch.sin(x) + 0.05 * torch.randn(32, 1, generator=gen)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()  # mix with the neighbours, update, send the result on
    if step % 10 == 0:
        bar.set_postfix(loss=f"{loss.item():.4f}")

opt.synchronize()  # finish the exchange still in flight before using the weights
x = torch.linspace(-3, 3, 200).unsqueeze(1)
with torch.no_grad():
    err = torch.nn.functional.mse_loss(model(x), torch.sin(x)).item()
print(f"rank {rank}: {steps} steps, mean squared error vs sin(x) = {err:.4f}")
if dist.is_initialized():
    dist.destroy_process_group()

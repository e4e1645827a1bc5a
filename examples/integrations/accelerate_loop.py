"""A training loop under Hugging Face Accelerate with a decentralized optimizer.

    torchrun --standalone --nproc-per-node 2 examples/integrations/accelerate_loop.py
    torchrun --standalone --nproc-per-node 2 examples/integrations/accelerate_loop.py --resume

Against a stock Accelerate script, three lines change: the import, ``Accelerator`` ->
``DecentralizedAccelerator``, and the optimizer. Gradient accumulation, ``save_state`` and
``load_state`` work as usual; the checkpoint holds every rank's own state.
"""

import argparse
import math

import torch
from torch import nn

import decent_optim as dopt
from decent_optim.integrations.accelerate import DecentralizedAccelerator


def sine_data(n: int, seed: int) -> torch.utils.data.TensorDataset:
    x = torch.rand(n, 1, generator=torch.Generator().manual_seed(seed)) * 2 * math.pi
    return torch.utils.data.TensorDataset(x, torch.sin(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3, help="passes over the data (default 3)")
    parser.add_argument("--out", default="accelerate-run", help="checkpoint folder")
    parser.add_argument("--resume", action="store_true", help="load the checkpoint first")
    args = parser.parse_args()

    # was: Accelerator(...); cpu=True on a machine without GPUs, or Accelerate sees one process
    accelerator = DecentralizedAccelerator(
        cpu=not torch.cuda.is_available(), gradient_accumulation_steps=2
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 1)).to(accelerator.device)
    # was: torch.optim.AdamW(model.parameters(), lr=1e-2); built after the model is on its device
    opt = dopt.DecentralizedAdamW(model.parameters(), lr=1e-2, topology="ring")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
    loader = torch.utils.data.DataLoader(sine_data(1024, seed=1), batch_size=16, shuffle=True)
    model, optimizer, loader, sched = accelerator.prepare(model, opt, loader, sched)
    if args.resume:
        accelerator.load_state(args.out)

    for epoch in range(args.epochs):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                sched.step()
                optimizer.zero_grad()
        accelerator.save_state(args.out)  # every rank: its own model and optimizer state too
        # `opt` is our optimizer; `optimizer` is Accelerate's wrapper around it
        with opt.averaged(model), torch.no_grad():  # the consensus model, on every rank
            x, y = sine_data(256, seed=2).tensors
            test = nn.functional.mse_loss(model(x.to(accelerator.device)), y.to(accelerator.device))
        accelerator.print(f"epoch {epoch}: test error of the consensus model {test.item():.4f}")
    if torch.distributed.is_initialized():  # gloo's threads must not outlive the interpreter
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

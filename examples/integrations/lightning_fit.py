"""A LightningModule trained with a decentralized optimizer and ``DecentralizedStrategy``.

    torchrun --standalone --nproc-per-node 2 examples/integrations/lightning_fit.py
    python examples/integrations/lightning_fit.py --devices 2     # Lightning starts the processes

Against a stock ``strategy="ddp"`` script, three lines change: the import, the strategy, and
the optimizer returned by ``configure_optimizers``. Validation runs on the consensus model;
``--resume`` continues from the last checkpoint (resume at an epoch boundary: Lightning's own
mid-epoch resume is not exact, with DDP either).
"""

import argparse
import math
import os

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

import decent_optim as dopt
from decent_optim.integrations.lightning import DecentralizedStrategy


def sine_loader(n: int, seed: int) -> torch.utils.data.DataLoader:
    x = torch.rand(n, 1, generator=torch.Generator().manual_seed(seed)) * 2 * math.pi
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.sin(x)), 16)


class Sine(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 1))

    def training_step(self, batch, index):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)  # each rank's loss differs: average it
        return loss

    def validation_step(self, batch, index):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        # was: torch.optim.AdamW(self.parameters(), lr=1e-2)
        opt = dopt.DecentralizedAdamW(self.parameters(), lr=1e-2, topology="ring")
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 30, 0.5)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3, help="passes over the data (default 3)")
    parser.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 2)))
    parser.add_argument("--out", default="lightning-run", help="checkpoint folder")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    args = parser.parse_args()

    torch.manual_seed(0)
    trainer = L.Trainer(
        max_epochs=args.epochs,
        strategy=DecentralizedStrategy(),  # was: strategy="ddp"
        accelerator="auto",
        devices=args.devices,
        callbacks=[ModelCheckpoint(dirpath=args.out, save_last=True)],
        enable_progress_bar=False,
        logger=False,
    )
    ckpt = os.path.join(args.out, "last.ckpt") if args.resume else None
    trainer.fit(Sine(), sine_loader(1024, seed=1), sine_loader(256, seed=2), ckpt_path=ckpt)
    if trainer.is_global_zero:
        print(f"val loss of the consensus model: {trainer.callback_metrics['val_loss']:.4f}")
    if torch.distributed.is_initialized():  # gloo's threads must not outlive the interpreter
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

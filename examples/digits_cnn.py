"""A small CNN with BatchNorm on scikit-learn's 8x8 digits, trained with decentralized SGD.

    python examples/digits_cnn.py                                        # one process
    torchrun --standalone --nproc-per-node 4 examples/digits_cnn.py     # four workers, gloo

The data set (1,797 images of handwritten digits) ships inside scikit-learn, so nothing is
downloaded. Each worker trains on its own shard of the training images. BatchNorm layers keep
running statistics in *buffers*, which gossip does not touch: every worker's statistics describe
its own shard only. For evaluation, ``opt.averaged(model)`` therefore averages both the
parameters and the floating-point buffers over all workers, the script evaluates that consensus
model, and every worker's own values come back so that training continues exactly as before.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from tqdm import tqdm

import decent_optim as dopt


def make_model() -> nn.Module:
    def block(c_in: int, c_out: int) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]

    return nn.Sequential(
        *block(1, 16),
        *block(16, 32),
        nn.MaxPool2d(2),  # 8x8 -> 4x4
        *block(32, 64),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    was_training = model.training
    model.eval()
    acc = (model(x).argmax(1) == y).float().mean().item()
    model.train(was_training)
    return acc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--topology", default="ring")
    parser.add_argument("--eval-every", type=int, default=100)
    args = parser.parse_args()

    torch.set_num_threads(1)
    if "WORLD_SIZE" in os.environ:  # started by torchrun
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    labels = torch.tensor(digits.target)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    test, train = order[:360], order[360:]  # the same split on every rank
    shard = train[rank::world_size]  # each worker sees only its own images
    x_test, y_test = images[test], labels[test]

    torch.manual_seed(0)
    model = make_model()
    opt = dopt.DSGD(
        model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, topology=args.topology
    )
    gen = torch.Generator().manual_seed(100 + rank)
    if rank == 0:
        print(
            f"{world_size} worker(s), {len(train)} training images ({len(shard)} on rank 0), "
            f"{len(test)} test images"
        )

    bar = tqdm(range(1, args.steps + 1), disable=rank != 0, mininterval=0.5)
    for step in bar:
        idx = shard[torch.randint(len(shard), (args.batch_size,), generator=gen)]
        loss = F.cross_entropy(model(images[idx]), labels[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.eval_every == 0 or step == args.steps:
            local = accuracy(model, x_test, y_test)  # this rank's own model and statistics
            with opt.averaged(model):  # parameters and BatchNorm buffers, restored after
                consensus = accuracy(model, x_test, y_test)
            if rank == 0:
                bar.write(
                    f"step {step:4d} | loss {loss.item():.3f} | test accuracy: consensus "
                    f"model {consensus:.3f}, rank 0's own model {local:.3f}"
                )

    if rank == 0:
        print(f"done: {args.steps} steps, test accuracy of the consensus model {consensus:.3f}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

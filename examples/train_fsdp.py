"""A small GPT sharded with FSDP2 inside each replica, replicas gossiping with DecentralizedAdamW.

    torchrun --standalone --nproc-per-node 4 examples/train_fsdp.py            # 2 replicas x 2 shards
    torchrun --standalone --nproc-per-node 4 examples/train_fsdp.py --shards 4 # 1 replica (no gossip)

The ranks form a 2-D mesh ``("replicate", "shard")``: each replica of the model is sharded with
FSDP2 on its 1-D ``mesh["shard"]`` (on a cluster: the GPUs of a node), and the optimizer gossips
over ``mesh["replicate"]`` (the same shard in the other replicas, across the slow network).
Every replica reads its own batches; the ranks of one replica read the same ones, and FSDP2
averages their gradients. Runs on CPU with gloo, or on GPUs with NCCL when CUDA is present.
At the end it prints the loss of the consensus model, saves a checkpoint per replica with
torch.distributed.checkpoint and exports the consensus weights as whole tensors.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import decent_optim


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), 1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, width: int, depth: int, heads: int, context: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batches(replica: int, vocab: int, context: int, size: int, device: torch.device):
    """Endless batches of a toy language (each token = previous two summed mod vocab), a
    stream of its own per replica."""
    g = torch.Generator().manual_seed(replica)
    while True:
        seq = torch.empty(size, context + 1, dtype=torch.long)
        seq[:, :2] = torch.randint(vocab, (size, 2), generator=g)
        for t in range(2, context + 1):
            seq[:, t] = (seq[:, t - 1] + seq[:, t - 2]) % vocab
        yield seq[:, :-1].to(device), seq[:, 1:].to(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=None, help="ranks per replica (FSDP2)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--topology", default="ring")
    ap.add_argument("--compression", default=None, choices=[None, "bf16", "int8"])
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("nccl" if cuda else "gloo")
    else:  # `python examples/train_fsdp.py`: a world of one
        store = tempfile.mktemp(prefix="train_fsdp-")
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda" if cuda else "cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    if args.shards is None:  # 2 replicas of 2 shards on 4 ranks
        args.shards = 2 if world >= 4 and world % 2 == 0 else 1
    if world % args.shards:
        raise SystemExit(f"--shards {args.shards} must divide the {world} ranks")
    mesh = init_device_mesh(
        device.type, (world // args.shards, args.shards), mesh_dim_names=("replicate", "shard")
    )
    replica = mesh["replicate"].get_local_rank()

    vocab, context = 32, 16
    torch.manual_seed(0)
    model = GPT(vocab, width=64, depth=2, heads=4, context=context).to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])  # the embeddings and the head
    opt = decent_optim.DecentralizedAdamW(
        model.parameters(),
        lr=3e-3,
        topology=args.topology,
        process_group=mesh["replicate"],  # gossip across replicas, shard by shard
        compression=args.compression,
    )

    data = batches(replica, vocab, context, 16, device)
    for step in range(1, args.steps + 1):
        x, y = next(data)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if rank == 0 and (step % 10 == 0 or step == 1):
            print(f"step {step:4d}  loss {loss.item():.3f}", flush=True)

    distance = opt.consensus_distance()
    x, y = next(batches(1000, vocab, context, 64, device))  # held-out batch, same on every rank
    with opt.averaged(model), torch.no_grad():
        consensus = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()

    # one checkpoint per replica: DCP would otherwise keep one copy of chunks that differ
    # between replicas and write a mix of them
    folder = os.environ.get("CKPT_DIR") or tempfile.gettempdir()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save(
        {"model": model_sd, "optim": optim_sd},
        checkpoint_id=os.path.join(folder, f"train_fsdp-replica{replica}"),
        process_group=mesh["shard"].get_group(),
    )
    export = opt.consensus_state_dict(model)  # whole tensors: loads into an unsharded GPT
    if rank == 0:
        torch.save(export, os.path.join(folder, "train_fsdp-consensus.pt"))
        print(
            f"done: {world // args.shards} replica(s) x {args.shards} shard(s), "
            f"consensus loss {consensus:.3f}, distance of rank 0's replica to the mean "
            f"{distance:.2e}; checkpoints in {folder}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

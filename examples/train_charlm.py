"""Train a small character-level GPT with decentralized AdamW.

    python examples/train_charlm.py                                         # one process
    torchrun --standalone --nproc-per-node 4 examples/train_charlm.py      # four workers, gloo

Every worker keeps its own model copy, samples its own batches and, at each step, averages its
parameters with its neighbours on the chosen topology. The only change from a plain PyTorch loop
is the optimizer line. The training text comes from a small grammar built into this script, so
the example needs no download.
"""

import argparse
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import decent_optim as dopt

CONTEXT, D_MODEL, HEADS, LAYERS = 64, 64, 4, 2


def make_corpus(n_sentences: int = 4000, seed: int = 1234) -> str:
    """English-like sentences with subject-verb agreement; the same text on every rank."""
    rng = random.Random(seed)
    nouns = ["cat", "dog", "bird", "child", "teacher", "farmer", "sailor", "robot"]
    verbs = ["see", "like", "follow", "find", "draw", "carry", "watch"]
    things = ["red ball", "green box", "old map", "tall tree", "small boat", "blue cup"]
    places = ["in the garden", "near the river", "on the hill", "at the market", "by the sea"]
    times = ["today", "every morning", "at night", "after lunch"]
    sentences = []
    for _ in range(n_sentences):
        noun, plural = rng.choice(nouns), rng.random() < 0.5
        subject = f"the {noun}s" if plural else rng.choice(["the ", "a "]) + noun
        verb = rng.choice(verbs)
        verb = verb if plural else verb + ("es" if verb.endswith(("ch", "sh")) else "s")
        words = [subject, verb, "the", rng.choice(things)]
        if rng.random() < 0.6:
            words.append(rng.choice(places))
        if rng.random() < 0.4:
            words.append(rng.choice(times))
        sentence = " ".join(words)
        sentences.append(sentence[0].upper() + sentence[1:] + ".")
    return " ".join(sentences) + "\n"


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (b, heads, t, d_head)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, D_MODEL), nn.Embedding(CONTEXT, D_MODEL)
        self.blocks = nn.Sequential(*[Block(D_MODEL, HEADS) for _ in range(LAYERS)])
        self.ln, self.head = nn.LayerNorm(D_MODEL), nn.Linear(D_MODEL, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.blocks(x)))


def get_batch(data: torch.Tensor, batch_size: int, gen: torch.Generator):
    starts = torch.randint(len(data) - CONTEXT - 1, (batch_size, 1), generator=gen)
    chunk = data[starts + torch.arange(CONTEXT + 1)]
    return chunk[:, :-1], chunk[:, 1:]


def mean_over_ranks(value: float, world_size: int) -> float:
    """For reporting only: training itself never needs a global average."""
    if world_size == 1:
        return value
    t = torch.tensor([value])
    dist.all_reduce(t)  # gloo has no AVG: sum, then divide
    return t.item() / world_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="ring", help="complete, ring, one-peer-exp, ...")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16, help="per worker")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=20)
    args = parser.parse_args()

    torch.set_num_threads(1)  # several workers may share a small CPU
    if "WORLD_SIZE" in os.environ:  # started by torchrun
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1

    text = make_corpus()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)

    torch.manual_seed(args.seed)  # same initial model everywhere (rank 0's is broadcast anyway)
    model = CharGPT(len(chars))
    opt = dopt.DecentralizedAdamW(  # was: torch.optim.AdamW(model.parameters(), ...)
        model.parameters(),
        lr=args.lr,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        topology=args.topology,
    )
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # own batches per rank

    if rank == 0:
        print(
            f"world size {world_size}, topology {args.topology}, {len(data):,} characters, "
            f"{sum(p.numel() for p in model.parameters()):,} parameters per worker"
        )
    first = last = float("nan")
    window = []  # this rank's losses since the last report
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = get_batch(data, args.batch_size, gen)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        window.append(loss.item())
        if step == 1:
            first = mean_over_ranks(window[0], world_size)
        if step % args.log_every == 0 or step == args.steps:
            last = mean_over_ranks(sum(window) / len(window), world_size)
            window = []
            if rank == 0:
                ms = 1000 * (time.perf_counter() - start) / step
                print(f"step {step:4d} | loss {last:.3f} (mean over ranks) | {ms:.0f} ms/it")
    opt.synchronize()  # mix in the gossip round still in flight
    per_iter = (time.perf_counter() - start) / args.steps

    if rank == 0:
        print(
            f"done: loss {first:.3f} (step 1) -> {last:.3f} (last report), "
            f"{1000 * per_iter:.0f} ms/iteration over {args.steps} steps, {world_size} worker(s)"
        )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

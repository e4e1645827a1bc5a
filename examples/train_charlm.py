"""Train a small character-level GPT with decentralized AdamW; optionally compare with All-Reduce.

    python examples/train_charlm.py                                         # one process
    torchrun --standalone --nproc-per-node 4 examples/train_charlm.py      # four workers, gloo
    torchrun --standalone --nproc-per-node 4 examples/train_charlm.py --compare --plot loss.png

Every worker keeps its own model copy, samples its own batches and, at each step, averages its
parameters with its neighbours on the chosen topology. The only change from a plain PyTorch loop
is the optimizer line. Every ``--eval-every`` steps the consensus model (the average of the
workers' models) is evaluated on a held-out part of the text. ``--baseline allreduce`` trains the
same model on the same data with DistributedDataParallel + torch.optim.AdamW instead;
``--compare`` runs both, one after the other, and ``--plot PATH`` draws their loss curves. The
training text comes from a small grammar built into this script, so the example needs no download.

Surviving failures (``--checkpoint-dir DIR``): every worker calls ``decent_optim.checkpoint.load``
at start -- nothing happens the first time -- and ``save`` every ``--save-every`` steps. When a
worker dies, its neighbours raise ``GossipError``; an elastic torchrun restarts the workers with
whatever nodes are left (or came back), and they continue from the newest complete checkpoint at
the new world size::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:2 --nproc-per-node 2 \
        --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint HOST:29400 --rdzv-id charlm \
        examples/train_charlm.py --checkpoint-dir /shared/ckpt --save-every 20 \
        --metrics /shared/metrics.jsonl

(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: a rendezvous store per restart; with torch's shared
one a restart fails or hangs, and the optimizer refuses to start. See docs/surviving_failures.)
"""

import argparse
import json
import os
import random
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from tqdm import tqdm

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


@dataclass
class Corpus:
    """The grammar text as character ids: the first 90% to train on, fixed held-out batches
    drawn from the last 10% (the same on every rank), and the vocabulary size."""

    train: torch.Tensor
    held_out: torch.Tensor
    val_batches: list[tuple[torch.Tensor, torch.Tensor]]
    vocab_size: int


def load_corpus(n_sentences: int = 4000, val_batches: int = 8) -> Corpus:
    text = make_corpus(n_sentences)
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    held_out = data[split:]
    val_gen = torch.Generator().manual_seed(12345)
    batches = [get_batch(held_out, 32, val_gen) for _ in range(val_batches)]
    return Corpus(data[:split], held_out, batches, len(chars))


def sum_over_ranks(values: list[float]) -> list[float]:
    """For reporting only: training itself never needs a global sum."""
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


@dataclass
class History:
    """What one run measured; rank 0 prints and plots it."""

    name: str
    train_steps: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)  # mean over ranks and log window
    eval_steps: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)  # of the consensus model
    ms_per_iter: float = float("nan")
    first_step: int = 1  # after a resume: the step after the checkpoint's
    steps_run: int = 0  # by this process (a resumed run does not repeat the saved steps)


@torch.no_grad()
def evaluate_consensus(
    model: nn.Module, eval_model: nn.Module, batches: list, world_size: int
) -> float:
    """Held-out loss of the consensus model: the mean of the workers' parameters.

    Until ``opt.averaged()`` lands (see the "coming" section of the docs), this averages a
    *copy* of the parameters over the ranks into a separate ``eval_model`` and leaves the
    training parameters alone. Reading them while a gossip round is in flight is allowed, and
    gossip preserves the mean, so no ``synchronize()`` is needed. Each rank evaluates its share
    of the fixed held-out batches.
    """
    flat = parameters_to_vector(model.parameters())
    if world_size > 1:
        dist.all_reduce(flat)  # gloo has no AVG: sum, then divide
        flat /= world_size
    vector_to_parameters(flat, eval_model.parameters())
    eval_model.eval()
    rank = dist.get_rank() if dist.is_initialized() else 0
    total, count = 0.0, 0
    for x, y in batches[rank::world_size]:
        total += F.cross_entropy(eval_model(x).flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
    total, count = sum_over_ranks([total, float(count)])
    return total / count


def train(args, method: str, data: torch.Tensor, val_batches: list, vocab: int) -> History:
    """One training run; ``method`` is "decentralized" or "allreduce"."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    torch.manual_seed(args.seed)  # same initial model everywhere (rank 0's is broadcast anyway)
    model = CharGPT(vocab)
    eval_model = CharGPT(vocab)
    if method == "decentralized":
        name = f"decent_optim AdamW, {args.topology}"
        forward = model
        opt: torch.optim.Optimizer = dopt.DecentralizedAdamW(  # was: torch.optim.AdamW(...)
            model.parameters(),
            lr=args.lr,
            betas=(0.9, 0.95),
            weight_decay=0.1,
            topology=args.topology,
            timeout=args.gossip_timeout,
        )
    else:
        name = "All-Reduce (DDP + AdamW)"
        forward = DistributedDataParallel(model) if world_size > 1 else model
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # own batches per rank
    first = 1
    if method == "decentralized" and args.checkpoint_dir:
        first = 1 + resume(args, model, opt, gen, rank)
    hist = History(name, first_step=first, steps_run=max(0, args.steps + 1 - first))
    if rank == 0:
        print(
            f"== {name}: world size {world_size}, global batch {args.batch_size * world_size}, "
            f"{sum(p.numel() for p in model.parameters()):,} parameters per worker"
        )

    window: list[float] = []  # this rank's losses since the last report
    bar = tqdm(
        total=args.steps,
        initial=first - 1,
        disable=rank != 0,
        desc=method,
        mininterval=0.5,
        leave=False,
    )
    start = time.perf_counter()
    for step in range(first, args.steps + 1):
        x, y = get_batch(data, args.batch_size, gen)
        loss = F.cross_entropy(forward(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        window.append(loss.item())
        bar.update()
        if step == first or step % args.log_every == 0 or step == args.steps:
            (mean,) = sum_over_ranks([sum(window) / len(window)])
            hist.train_steps.append(step)
            hist.train_loss.append(mean / world_size)
            window = []
            bar.set_postfix(loss=f"{hist.train_loss[-1]:.3f}")
            if args.metrics and rank == 0:
                record(args.metrics, step=step, world_size=world_size, loss=hist.train_loss[-1])
        if method == "decentralized" and args.checkpoint_dir and step % args.save_every == 0:
            extra = {"generator": gen.get_state()}
            dopt.checkpoint.save(
                args.checkpoint_dir, model, opt, step=step, extra=extra, background=args.background
            )
        if step % args.eval_every == 0 or step == args.steps:
            hist.eval_steps.append(step)
            hist.eval_loss.append(evaluate_consensus(model, eval_model, val_batches, world_size))
            ms = 1000 * (time.perf_counter() - start) / (step + 1 - first)  # steps timed
            if rank == 0:  # tqdm.write prints on every rank, disabled bar or not
                bar.write(
                    f"step {step:4d} | train loss {hist.train_loss[-1]:.3f} (mean over ranks) "
                    f"| val loss {hist.eval_loss[-1]:.3f} (consensus model) | {ms:.0f} ms/it"
                )
    if isinstance(opt, dopt.DecentralizedOptimizer):
        opt.synchronize()  # mix in the gossip round still in flight
    if method == "decentralized" and args.checkpoint_dir:
        dopt.checkpoint.wait(args.checkpoint_dir)  # the save in flight (rank 0 commits it)
    hist.ms_per_iter = 1000 * (time.perf_counter() - start) / max(1, hist.steps_run)
    bar.close()
    return hist


def summary(h: History, steps: int) -> str:
    """The closing line of a run; a resumed run names the step it started from, not step 1."""
    if not h.steps_run:
        return f"done: {h.name}: nothing to train, the checkpoint is at step {steps} already"
    resumed = f"resumed at step {h.first_step}, " if h.first_step > 1 else ""
    return (
        f"done: {h.name}: train loss {h.train_loss[0]:.3f} (step {h.train_steps[0]}) -> "
        f"{h.train_loss[-1]:.3f} (step {h.train_steps[-1]}), held-out loss "
        f"{h.eval_loss[-1]:.3f}, {h.ms_per_iter:.0f} ms/iteration over {h.steps_run} steps "
        f"({resumed}{steps} in all)"
    )


def resume(args, model: nn.Module, opt, gen: torch.Generator, rank: int) -> int:
    """Continue from the newest complete checkpoint, at this world size; returns its step (0: none).

    With the world size it was saved with, each rank gets its own model, optimizer state and
    batch generator back, and the run continues as if never stopped. With another one, every
    rank starts from the mean of the saved models (``--resize-rule``), and draws new batches.
    """
    resumed = dopt.checkpoint.load(args.checkpoint_dir, model, opt, rule=args.resize_rule)
    if resumed.source == "own":
        gen.set_state(resumed.extra["generator"])
    elif resumed.step:
        gen.manual_seed(args.seed * 1000 + rank + 7919 * resumed.step)
    if resumed.step and rank == 0:
        print(
            f"resumed from step {resumed.step} (saved by {resumed.saved_world_size} ranks, now "
            f"{opt.world_size}; each rank starts from: {resumed.source})",
            flush=True,
        )
    if args.metrics and rank == 0:
        record(args.metrics, event="start", step=resumed.step, world_size=opt.world_size)
    return resumed.step


def record(path: str, **fields) -> None:
    """Append one JSON line (rank 0): the loss curve across restarts, for plotting."""
    with open(path, "a") as f:
        f.write(json.dumps({"time": time.time(), **fields}) + "\n")


def plot(histories: list[History], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, h in enumerate(histories):
        color = f"C{i}"
        ax.plot(h.train_steps, h.train_loss, color=color, alpha=0.6, label=f"{h.name}: train")
        ax.plot(h.eval_steps, h.eval_loss, "o--", color=color, label=f"{h.name}: held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per character)")
    ax.set_title("Character GPT: loss vs step")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="ring", help="complete, ring, one-peer-exp, ...")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16, help="per worker")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10, help="steps between loss reports")
    parser.add_argument("--eval-every", type=int, default=50, help="steps between evaluations")
    parser.add_argument(
        "--baseline", choices=["allreduce"], help="train with DDP + torch.optim.AdamW instead"
    )
    parser.add_argument("--compare", action="store_true", help="run decentralized, then baseline")
    parser.add_argument("--plot", metavar="PATH", help="write a loss-vs-step PNG (rank 0)")
    parser.add_argument("--checkpoint-dir", help="save there and resume from there (shared)")
    parser.add_argument("--save-every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--background", action="store_true", help="save in a thread")
    parser.add_argument("--resize-rule", default="consensus", choices=dopt.checkpoint.RULES)
    parser.add_argument("--metrics", metavar="PATH", help="append the losses as JSON lines")
    parser.add_argument(
        "--gossip-timeout", type=float, default=60.0, help="seconds before a peer counts as dead"
    )
    args = parser.parse_args()

    torch.set_num_threads(1)  # several workers may share a small CPU
    if "WORLD_SIZE" in os.environ:  # started by torchrun
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0

    corpus = load_corpus()
    if rank == 0:
        print(f"{len(corpus.train):,} training and {len(corpus.held_out):,} held-out characters")

    methods = ["allreduce" if args.baseline else "decentralized"]
    if args.compare:
        methods = ["decentralized", "allreduce"]
    histories = [
        train(args, m, corpus.train, corpus.val_batches, corpus.vocab_size) for m in methods
    ]

    if rank == 0:
        for h in histories:
            print(summary(h, args.steps))
        if args.plot:
            plot(histories, args.plot)
            print(f"wrote {args.plot}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

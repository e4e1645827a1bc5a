"""Device seconds per training step of GPT-shaped models, and the regime R they give on a link.

R = (seconds for one fp32 copy of the model to cross a link) / (device seconds per step), the
regime of ``docs/regimes.rst``. This measures the denominator on the machine at hand: a
GPT-2-shaped model (pre-norm blocks of ``torch.nn.TransformerEncoderLayer`` with a causal mask,
tied nothing) of ``--shape``, forward, backward and a fused AdamW step under bf16 autocast,
median of ``--iters`` after ``--warmup``, with CUDA events on a GPU. Then R at 1, 10 and 100
Gbit/s for that step.

    PYTHONPATH=$PWD python benchmarks/step_time.py --shape gpt-124m --batch 16
    PYTHONPATH=$PWD python benchmarks/step_time.py --device cpu --shape tiny --iters 2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from codec_speed import median_ms  # noqa: E402

#: name: (d_model, layers, heads, context, vocab)
SHAPES = {
    "tiny": (64, 2, 2, 64, 256),
    "gpt-124m": (768, 12, 12, 1024, 50304),
    "gpt-350m": (1024, 24, 16, 1024, 50304),
    "gpt-1.3b": (2048, 24, 16, 1024, 50304),
}
LINKS_GBIT = (1, 10, 100)


class GPT(nn.Module):
    def __init__(self, d: int, layers: int, heads: int, context: int, vocab: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        layer = nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        return self.head(self.ln(self.blocks(x, mask=mask, is_causal=True)))


def measure(shape: str, batch: int, device: torch.device, iters: int, warmup: int) -> dict:
    d, layers, heads, context, vocab = SHAPES[shape]
    model = GPT(d, layers, heads, context, vocab).to(device)
    numel = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    x = torch.randint(vocab, (batch, context), device=device)
    y = torch.randint(vocab, (batch, context), device=device)
    dtype = torch.bfloat16

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype):
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step_s = median_ms(device, step, iters, warmup) / 1e3
    copy_bits = 32 * numel
    return {
        "shape": shape,
        "params": numel,
        "batch": batch,
        "context": context,
        "tokens_per_step": batch * context,
        "step_s": step_s,
        "R": {g: copy_bits / (g * 1e9) / step_s for g in LINKS_GBIT},
        "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", nargs="+", default=["gpt-124m"], choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, nargs="+", default=[16])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = []
    links = " | ".join(f"R at {g} Gbit/s" for g in LINKS_GBIT)
    print(f"| shape | params | batch x context | s / step | {links} | peak GB |")
    print("|---|---:|---|---:|" + "---:|" * len(LINKS_GBIT) + "---:|")
    for shape in args.shape:
        for batch in args.batch:
            r = measure(shape, batch, device, args.iters, args.warmup)
            rows.append(r)
            rs = " | ".join(f"{r['R'][g]:.2f}" for g in LINKS_GBIT)
            peak = "-" if r["peak_gb"] is None else f"{r['peak_gb']:.1f}"
            print(
                f"| {shape} | {r['params'] / 1e6:.1f}M | {batch} x {r['context']} | "
                f"{r['step_s']:.4f} | {rs} | {peak} |",
                flush=True,
            )
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()

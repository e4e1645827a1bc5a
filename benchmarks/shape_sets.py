"""Parameter shapes the optimizer benchmarks step: synthetic sets and GPT-style models.

``gpt-125m`` and ``gpt-1.3b`` are GPT-2-style transformers (token and position embeddings; per
block two layer norms, the fused qkv and output projections of attention, the MLP's two
matrices with their biases; a final layer norm; the head tied to the token embedding):

* ``gpt-125m``: d=768, 12 blocks, vocabulary 50257, context 1024 (124.4M parameters);
* ``gpt-1.3b``: d=2048, 24 blocks, vocabulary 50257, context 2048 (1.32B parameters);
* ``gpt-tiny``: d=64, 2 blocks, vocabulary 512, context 64 (the CPU smoke run).
"""

from __future__ import annotations

GPT = {
    "gpt-tiny": dict(d=64, layers=2, vocab=512, context=64),
    "gpt-125m": dict(d=768, layers=12, vocab=50257, context=1024),
    "gpt-1.3b": dict(d=2048, layers=24, vocab=50257, context=2048),
}
NAMES = ["many-small", "few-large", *GPT]


def gpt(d: int, layers: int, vocab: int, context: int) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [(vocab, d), (context, d)]
    for _ in range(layers):
        out += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,)]  # ln_1, attention
        out += [(d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]  # ln_2, MLP
    return out + [(d,), (d,)]  # ln_f


def shapes(name: str) -> list[tuple[int, ...]]:
    if name == "many-small":  # ~ 600 tensors, 2.4M parameters: biases, norms, small matrices
        out: list[tuple[int, ...]] = []
        for _ in range(150):
            out += [(64, 128), (128,), (128, 64), (64,)]
        return out
    if name == "few-large":  # 4 tensors, 10.5M parameters
        return [(2048, 2048), (2048, 1024), (1024, 2048), (1024, 2048)]
    if name in GPT:
        return gpt(**GPT[name])
    raise ValueError(f"unknown shape set {name!r}; one of {', '.join(NAMES)}")

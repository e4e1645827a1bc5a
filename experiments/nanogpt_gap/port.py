"""Port nanoGPT's train.py/model.py (commit 3adf61e) to decent_optim, with switches for a study.

``python port.py NANOGPT_DIR`` edits the checkout in place. The environment of each run then
picks the optimizer: ``OPT=ddp`` keeps nanoGPT's DDP + torch.optim.AdamW; anything else builds
``decent_optim.DecentralizedAdamW`` (``AccumAdamW`` with ``ACC=k``) with ``TOPO`` (default
ring), ``H`` (``local_steps``, default 1) and ``COMP`` (compression). ``SEED`` replaces the 1337
base seed. Both paths evaluate on the same held-out batches (a seeded generator), ours the
consensus model (``optimizer.averaged``), and print a last evaluation over ``FINAL_EVAL_ITERS``
batches (default 100) after the loop. The lines a user of ours changes are those of the docs
(docs/time_to_quality.rst, "nanoGPT's shakespeare_char"); the switches only let one checkout
run both.
"""

import pathlib
import sys

OPTIMIZER = """        if os.environ.get('OPT', 'ddp') == 'ddp':
            optimizer = torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **extra_args)
        else:
            cls = decent_optim.AccumAdamW if os.environ.get('ACC') else decent_optim.DecentralizedAdamW
            extra = dict(accum_iter=int(os.environ['ACC'])) if os.environ.get('ACC') else {}
            optimizer = cls(optim_groups, lr=learning_rate, betas=betas, **extra,
                topology=os.environ.get('TOPO', 'ring'), local_steps=int(os.environ.get('H', 1)),
                compression=os.environ.get('COMP') or None)
"""
EVAL = """    if iter_num % eval_interval == 0:
        if decent:
            with optimizer.averaged(raw_model): # a collective: the consensus model
                losses = estimate_loss()
        else:
            losses = estimate_loss()
    if iter_num % eval_interval == 0 and master_process:
"""
FINAL = """final_iters = int(os.environ.get('FINAL_EVAL_ITERS', 100))
if decent:
    with optimizer.averaged(raw_model):
        losses = estimate_loss(final_iters)
else:
    losses = estimate_loss(final_iters)
if master_process:
    print(f"final: val loss {losses['val']:.6f} train loss {losses['train']:.6f} ({final_iters} batches)")
"""
CUDA = "    device = f'cuda:{ddp_local_rank}'\n    torch.cuda.set_device(device)\n"
MODEL = {
    "import inspect\n": "import inspect\nimport os\nimport decent_optim\n",
    "        optimizer = torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **extra_args)\n": OPTIMIZER,
}
TRAIN = {
    CUDA: "    if device.startswith('cuda'):\n" + CUDA.replace("    ", "        "),
    "torch.manual_seed(1337 + seed_offset)": "decent = os.environ.get('OPT', 'ddp') != 'ddp'\n"
    "torch.manual_seed(int(os.environ.get('SEED', 1337)) + seed_offset)",
    "def get_batch(split):": "def get_batch(split, generator=None):",
    "(len(data) - block_size, (batch_size,))": "(len(data) - block_size, (batch_size,), generator=generator)",
    "if ddp:\n    model = DDP(model, device_ids=[ddp_local_rank])": "if ddp and not decent:\n"
    "    model = DDP(model, device_ids=[ddp_local_rank] if device.startswith('cuda') else None)",
    "def estimate_loss():": "def estimate_loss(eval_iters=eval_iters):",
    "        losses = torch.zeros(eval_iters)\n": "        losses = torch.zeros(eval_iters)\n"
    "        gen = torch.Generator().manual_seed(0) # the same held-out batches, every rank\n",
    "            X, Y = get_batch(split)\n": "            X, Y = get_batch(split, gen)\n",
    "raw_model = model.module if ddp else model": "raw_model = model.module if ddp and not decent else model",
    "    if iter_num % eval_interval == 0 and master_process:\n        losses = estimate_loss()\n": EVAL,
    "        if ddp:\n            # in DDP": "        if ddp and not decent:\n            # in DDP",
    "    if iter_num > max_iters:\n        break\n": "    if iter_num > max_iters:\n        break\n"
    + FINAL,
}


def edit(path: pathlib.Path, edits: dict[str, str]) -> None:
    text = path.read_text()
    for old, new in edits.items():
        if text.count(old) != 1:
            sys.exit(f"{path}: expected one {old!r}; is this nanoGPT at commit 3adf61e, unported?")
        text = text.replace(old, new)
    path.write_text(text)


if __name__ == "__main__":
    root = pathlib.Path(sys.argv[1])
    edit(root / "model.py", MODEL)
    edit(root / "train.py", TRAIN)
    print(f"ported {root}")

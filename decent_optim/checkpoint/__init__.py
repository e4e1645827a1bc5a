"""Checkpoints that survive the crash they are for, and resume at any world size.

One call per rank to save, one to load::

    resumed = decent_optim.checkpoint.load("ckpt", model, opt)   # 0 when there is none yet
    for step in range(resumed.step + 1, total + 1):
        ...
        if step % 100 == 0:
            decent_optim.checkpoint.save("ckpt", model, opt, step=step, background=True)
    decent_optim.checkpoint.wait("ckpt")

A folder per step, a file per rank, a manifest written last (:mod:`.directory`); saving without
collectives, in the background if asked (:mod:`.saving`, :mod:`.writers`); loading at the saved
world size (exact) or another one (:mod:`.resize`'s rule, :mod:`.loading`). What would lose or
mix checkpoints is refused before anything is written: bad arguments, sharded models, an
``extra`` that would not load back (:mod:`.refusals`), two models in one folder
(:mod:`.ownership`). A step saved again after going back (``load(step=...)``) never mixes
the two trajectories (:mod:`.lineage`).

Why ``torch.save`` and not ``torch.distributed.checkpoint`` (DCP): DCP saves one logical copy of a
tensor that every rank holds (it deduplicates replicated state) and reshards *slices* of one
global tensor; here every rank holds a whole copy of its own, with different values, and the
resize rule needs all N copies (their mean) or a chosen one, which DCP's planner does not express.
``torch.save`` per rank writes each copy as it is, is read back memory-mapped, and needs no
process group (the background writer runs no collective).
"""

from decent_optim.checkpoint.directory import Manifest, WriteError, latest
from decent_optim.checkpoint.loading import Resumed, load
from decent_optim.checkpoint.resize import RULES
from decent_optim.checkpoint.saving import save, wait

__all__ = ["RULES", "Manifest", "Resumed", "WriteError", "latest", "load", "save", "wait"]

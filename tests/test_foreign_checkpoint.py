"""A rank loading another rank's optimizer file is told which framework adapter keeps a file
per rank, Lightning's included (the message named only the Accelerate and HF adapters)."""

from __future__ import annotations

import pytest
import torch

import decent_optim as dopt
from decent_optim.optim.checkpoint import KEY


def test_foreign_rank_refusal_names_every_adapter():
    opt = dopt.DSGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    saved = opt.state_dict()
    saved[KEY]["rank"] = 1  # as if rank 1 had written it (what a framework's rank-0 file is
    # for every rank but 0)
    with pytest.raises(ValueError, match="saved by rank 1") as caught:
        opt.load_state_dict(saved)
    for adapter in ("DecentralizedAccelerator", "DecentralizedTrainer", "DecentralizedStrategy"):
        assert adapter in str(caught.value), caught.value

"""A rank loading another rank's optimizer file is told which framework adapter keeps a file
per rank, Lightning's included (the message named only the Accelerate and HF adapters); a
sharded optimizer's state that names another replica is refused the same way; and
``another_replica=True`` loads another rank's state on purpose.

A world of one stands in for rank 0: the files are edited to say another rank saved them."""

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


def _as_another_rank(opt, rank):
    saved = opt.state_dict()
    saved[KEY]["rank"] = rank
    return saved


def test_another_ranks_state_loads_when_asked():
    param = torch.nn.Parameter(torch.zeros(2))
    opt = dopt.DSGD([param], lr=0.1, momentum=0.9)
    param.grad = torch.ones(2)
    opt.step()
    saved = _as_another_rank(opt, 1)
    with pytest.raises(ValueError, match="another_replica=True"):
        opt.load_state_dict(saved)
    opt.load_state_dict(saved, another_replica=True)
    assert opt.state_dict()[KEY]["rank"] == 0  # the next save is this rank's own again


def _as_a_replicas_full_state(opt, replica):
    """What torch.distributed.checkpoint's state-dict tools keep of a sharded optimizer's state
    dict: "state" and "param_groups", the shared entries in param_groups[0] (see
    decent_optim.optim.checkpoint.save), the replica's index a 0-d tensor once pickled."""
    saved = opt.state_dict()
    entry = saved.pop(KEY)
    shared = {k: entry[k] for k in ("step", "pending", "world_size", "topology")}
    saved["param_groups"][0][KEY] = {**shared, "replica": torch.tensor(replica)}
    return saved


@pytest.mark.parametrize("replica", [0, 1])
def test_a_full_state_dict_of_another_replica_is_refused(replica):
    opt = dopt.DecentralizedAdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    saved = _as_a_replicas_full_state(opt, replica)
    if replica == 0:  # its own: loads, as torch.optim's would
        opt.load_state_dict(saved)
        return
    with pytest.raises(ValueError, match="replica 0 of 1 loaded the optimizer state saved by "
                       "replica 1") as caught:  # fmt: skip
        opt.load_state_dict(saved)
    for fix in ("full_state_dict=True", "FSDP2 example", "process_group=mesh['shard']",
                "DecentralizedModelParallelStrategy", "another_replica=True"):  # fmt: skip
        assert fix in str(caught.value), fix
    opt.load_state_dict(saved, another_replica=True)

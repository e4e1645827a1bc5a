"""``decent:...:node``: one replica per node, sharded over the node's ranks with FSDP2.

Each node's ranks take a gradient step on the node's batch together (FSDP2 all-gathers the
layers and reduce-scatters the gradients inside the node) and hold one copy of the model between
them; the replicas gossip across nodes, each rank its shard (docs/large_models.rst). With ``k``
ranks a node, a rank's step averages ``k`` times the sequences and sends ``1/k`` of a copy.
"""

from __future__ import annotations

import os

import _peers
import torch.distributed as dist
from torch import nn


def shard_in_the_node(model: nn.Module, per_node: int | None) -> dict:
    """Shard ``model`` (in place) over the ``per_node`` ranks of this rank's node (default:
    torchrun's ``LOCAL_WORLD_SIZE``); returns the optimizer's gossip arguments (the model's
    parameters are then the shards)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    per_node = per_node or int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # torchrun's, per node
    n = dist.get_world_size()
    if per_node < 2 or n % per_node:
        raise SystemExit(f":node needs --local-world-size >= 2 dividing {n} ranks")
    mesh = init_device_mesh("cpu", (n // per_node, per_node), mesh_dim_names=("replicate", "shard"))
    for layer in _peers.layer_modules(model):
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    return dict(process_group=mesh["replicate"], local_world_size=1)

"""Why a bare ``dcp.load`` (no ``set_state_dict``) goes unseen by a sharded optimizer (issue 25).

Usage: ``python experiments/bare_dcp_load.py`` (4 gloo ranks, 2 replicas x 2 shards, a few
seconds). Saves each replica with DCP after 3 steps; then new models and optimizers load those
checkpoints with ``dcp.load`` into ``get_model_state_dict(model)`` and nothing else. Prints per
rank whether the loaded values reached the parameters, the version of the parameter's local
tensor and of the state dict's before and after, and whether the optimizer's mirror saw a write
(``moved()``): the values arrive, the parameter's version does not move, the mirror sees nothing.
"""

from __future__ import annotations

import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def job(rank, world_size, path, phase):
    import torch
    import torch.distributed.checkpoint as dcp
    from test_sharded import _build, _full, _steps
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model, opt, mesh = _build()
    group = mesh["shard"].get_group()
    checkpoint = f"{path}/replica{rank // 2}"
    if phase == "save":
        _steps(model, opt, rank // 2, 0, 3)
        dcp.save(
            {"model": get_model_state_dict(model)}, checkpoint_id=checkpoint, process_group=group
        )
        return _full(model)
    state = get_model_state_dict(model)
    p, name = next(iter(model.parameters())), next(iter(state))
    local, alias = p._local_tensor, state[name]._local_tensor
    before = (local._version, alias._version)
    dcp.load({"model": state}, checkpoint_id=checkpoint, process_group=group)
    mirrors = [b.mirror.moved() for b in opt._flat.buckets if b.mirror is not None]
    return {
        "alias shares storage": alias.untyped_storage().data_ptr()
        == local.untyped_storage().data_ptr(),
        "versions (parameter, state dict) before": before,
        "after": (local._version, alias._version),
        "mirror saw a write": any(mirrors),
        "loaded": [t.clone() for t in _full(model)],
        "torch": torch.__version__,
    }


def main() -> None:
    from _harness import run_world

    with tempfile.TemporaryDirectory() as path:
        saved = run_world(job, 4, path, "save")
        loaded = run_world(job, 4, path, "load")
    for rank, out in enumerate(loaded):
        arrived = all(a.equal(b) for a, b in zip(out.pop("loaded"), saved[rank]))
        print(f"rank {rank}: values arrived {arrived}, {out}")


if __name__ == "__main__":
    main()

"""The benchmark's Streaming DiLoCo peers: ours (``_streaming_diloco.py``) and torchft's as shipped.

``sdiloco:H<h>:F<f>:tau<t>[:alpha<a>][:q4|:q8]`` is the paper's recipe in our code: layers dealt
to fragments in turn (strided). ``torchft-diloco:H<h>`` and
``torchft-sdiloco:H<h>:F<f>:tau<t>[:alpha<a>][:q8]`` are ``torchft.local_sgd.DiLoCo`` 0.2.0
(``pip install torchft==0.2.0``, a benchmark extra only) with its own fragments: contiguous runs
of layers, as its examples build them. Each rank is one torchft replica (a replica group of
one): rank 0 runs the Lighthouse (quorum of all ranks), every rank its own TCPStore, Manager
and ``ProcessGroupGloo``, so it runs on CPU. torchft's ``should_quantize`` (``:q8``) needs
triton; without it (CPU) torchft silently all-reduces in fp32, which the harness notes.
With ``:hetero`` each replica gets its own ``sync_every`` (``methods.local_steps``): torchft
counts inner steps per replica and picks the fragment to sync by the Manager's step (one per
committed sync, the same on every replica), so replicas with different ``sync_every`` still
all-reduce the same fragment at the k-th sync, averaged by the number of replicas.
Both wrap the inner AdamW and keep the harness's interface: ``param_groups``, ``zero_grad``,
``step``, ``averaged()`` (the workers' mean, over the harness's process group) and ``close()``.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from _diloco import averaged_parameters


def layer_modules(model: nn.Module) -> list[nn.Module]:
    """The model's layers in order: each element of a top-level Sequential or ModuleList (the
    transformer blocks), and every other top-level child with parameters as one layer."""
    out: list[nn.Module] = []
    for child in model.children():
        if isinstance(child, nn.Sequential | nn.ModuleList):
            out.extend(child)
        elif any(True for _ in child.parameters()):
            out.append(child)
    return out


def this_host() -> str:
    """The address other ranks reach this one at: the emulated node's, localhost on one node."""
    if os.environ.get("EMU_NODE_ADDR"):
        return os.environ["EMU_NODE_ADDR"]
    one_node = os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")
    return "localhost" if one_node else socket.gethostname()


class TorchftDiLoCo:
    """``torchft.local_sgd.DiLoCo`` with one replica per rank, on CPU and gloo."""

    def __init__(self, model: nn.Module, layers: list[nn.Module], inner, m: dict, outer: dict):
        from torchft import Manager, ProcessGroupGloo
        from torchft.coordination import LighthouseServer
        from torchft.local_sgd import DiLoCo

        rank, n = dist.get_rank(), dist.get_world_size()
        self.model, self.inner, self.lighthouse = model, inner, None
        host = this_host()
        address = [None]
        if rank == 0:
            self.lighthouse = LighthouseServer(bind="[::]:0", min_replicas=n)
            port = self.lighthouse.address().rsplit(":", 1)[1]
            address = [f"http://{host}:{port}"]
        dist.broadcast_object_list(address, src=0)
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        timeout = timedelta(seconds=120)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
            min_replica_size=n, use_async_quorum=False, timeout=timeout, quorum_timeout=timeout,
            rank=0, world_size=1, store_addr=host, store_port=self.store.port, hostname=host,
            lighthouse_addr=address[0], replica_id=f"bench_{rank}", init_sync=False,
        )  # fmt: skip
        f = m["F"]  # contiguous runs of layers, as torchft's examples make its fragments
        bounds = [round(i * len(layers) / f) for i in range(f + 1)]
        fragments = [nn.ModuleList(layers[a:b]) for a, b in zip(bounds, bounds[1:])]
        rates = {"lr": 0.7, "momentum": 0.9, **outer}
        outers = [torch.optim.SGD(frag.parameters(), nesterov=True, **rates) for frag in fragments]
        self.diloco = DiLoCo(self.manager, list(fragments), inner, outers, m["H"],
                             should_quantize=m["bits"] is not None, fragment_sync_delay=m["tau"],
                             fragment_update_alpha=m["alpha"])  # fmt: skip
        self.diloco.__enter__()

    @property
    def param_groups(self):
        return self.inner.param_groups

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def step(self) -> None:
        self.inner.step()  # torchft's hooks on it do the rest

    def averaged(self):
        return averaged_parameters(list(self.model.parameters()))

    def close(self) -> None:
        self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
        dist.barrier()  # every replica done with the lighthouse before it goes
        if self.lighthouse is not None:
            self.lighthouse.shutdown()

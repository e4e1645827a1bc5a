"""decent_optim: decentralized data-parallel optimizers for PyTorch.

Replace ``torch.optim.AdamW(...)`` by ``decent_optim.DecentralizedAdamW(..., topology="ring")``
and launch with torchrun: every worker keeps its own model and averages it with a few neighbours
per step, while the next forward and backward run.
"""

from decent_optim import checkpoint, topologies
from decent_optim.advice import Advice, recommend
from decent_optim.gossip.elastic import check_restarted_worker
from decent_optim.optim.accum_adam import AccumAdam, AccumAdamW
from decent_optim.optim.dadam import DecentralizedAdam, DecentralizedAdamW
from decent_optim.optim.dsgd import DSGD
from decent_optim.optim.engine import DecentralizedOptimizer
from decent_optim.optim.outer import LocalOuterSGD, OuterSGD
from decent_optim.optim.schedules import Uneven
from decent_optim.topologies import Topology
from decent_optim.wrappers import unwrap

__version__ = "0.2.0"

# a worker that torchrun restarted with a shared rendezvous store fails or hangs in
# init_process_group, before it could build an optimizer and be told why: tell it now
# (decent_optim.gossip.elastic)
check_restarted_worker()

__all__ = [
    "DSGD",
    "Advice",
    "AccumAdam",
    "AccumAdamW",
    "DecentralizedAdam",
    "DecentralizedAdamW",
    "DecentralizedOptimizer",
    "LocalOuterSGD",
    "OuterSGD",
    "Uneven",
    "Topology",
    "__version__",
    "checkpoint",
    "recommend",
    "topologies",
    "unwrap",
]

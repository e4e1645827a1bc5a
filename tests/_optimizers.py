"""The five optimizers with small hyper-parameters, for tests that run each of them.

``EVERY_OPTIMIZER``: ``(class, keyword arguments)``; ``TORCH_COUNTERPART`` maps a class to the
``torch.optim`` class it equals at world size 1 with those arguments (AccumAdam(W) with
``accum_iter=2`` has none).
"""

import torch

import decent_optim as dopt

EVERY_OPTIMIZER = [
    (dopt.DSGD, dict(lr=0.05, momentum=0.9)),
    (dopt.DecentralizedAdam, dict(lr=0.01)),
    (dopt.DecentralizedAdamW, dict(lr=0.01, weight_decay=0.1)),
    (dopt.AccumAdam, dict(lr=0.01, accum_iter=2)),
    (dopt.AccumAdamW, dict(lr=0.01, accum_iter=2)),
]

TORCH_COUNTERPART = {
    dopt.DSGD: torch.optim.SGD,
    dopt.DecentralizedAdam: torch.optim.Adam,
    dopt.DecentralizedAdamW: torch.optim.AdamW,
}

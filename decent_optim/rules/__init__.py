"""Update rules: each algorithm's local step, driven by the engine (see :mod:`decent_optim.rules.base`).

=================  ==========================================================================
rule               used by
=================  ==========================================================================
``AdamRule``       :class:`~decent_optim.DecentralizedAdam`, :class:`~decent_optim.DecentralizedAdamW`
``SgdRule``        :class:`~decent_optim.DSGD`
``AccumAdamRule``  :class:`~decent_optim.AccumAdam`, :class:`~decent_optim.AccumAdamW`
=================  ==========================================================================

A new algorithm is a new rule module here plus a thin class in :mod:`decent_optim.optim`.
"""

from decent_optim.rules.accum_adam import AccumAdamRule
from decent_optim.rules.adam import AdamRule
from decent_optim.rules.base import Amp, Batch, UpdateRule
from decent_optim.rules.sgd import SgdRule

__all__ = ["AccumAdamRule", "AdamRule", "Amp", "Batch", "SgdRule", "UpdateRule"]

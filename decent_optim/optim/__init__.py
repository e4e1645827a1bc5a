"""The optimizer classes; import them from :mod:`decent_optim`."""

from decent_optim.optim.accum_adam import AccumAdam, AccumAdamW
from decent_optim.optim.dadam import DecentralizedAdam, DecentralizedAdamW
from decent_optim.optim.dsgd import DSGD

__all__ = ["DSGD", "AccumAdam", "AccumAdamW", "DecentralizedAdam", "DecentralizedAdamW"]

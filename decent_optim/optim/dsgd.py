"""DSGD: torch.optim.SGD applied to parameters mixed with the topology's neighbours."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from decent_optim._validation import check_lr, check_momentum, check_weight_decay
from decent_optim.optim.engine import DecentralizedOptimizer
from decent_optim.optim.options import Options, ParamsT
from decent_optim.rules.sgd import SgdRule

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["DSGD"]


class DSGD(DecentralizedOptimizer):
    r"""Decentralized SGD: average with the neighbours, then take a :class:`torch.optim.SGD` step.

    .. math::
        \tilde x_i = \textstyle\sum_j W^{(t)}_{ij}\, x_j, \qquad
        b \leftarrow \mu b + (1-\tau)\, g_i, \qquad x_i \leftarrow \tilde x_i - \eta\, b,
        \qquad g_i = \nabla f(x_i;\ \xi_i) + \lambda \tilde x_i

    Momentum :math:`\mu`, dampening :math:`\tau`, Nesterov, L2 weight decay :math:`\lambda` and
    ``maximize`` behave as in torch (the buffer :math:`b` starts at the first gradient); with
    ``momentum=0`` this is D-PSGD (Lian et al., 2017). The neighbours' values travel while the
    next forward and backward run. With one worker :math:`W=[1]` and this is exactly
    :class:`torch.optim.SGD`.

    Args:
        params: parameters or param groups, as for :class:`torch.optim.SGD`.
        lr, momentum, dampening, weight_decay, nesterov: as for :class:`torch.optim.SGD`.
        options: ``topology``, ``process_group``, ... and torch.optim's flags (``maximize``,
            ...): see :class:`~decent_optim.DecentralizedOptimizer`.

    Example:
        >>> opt = DSGD(model.parameters(), lr=0.1, momentum=0.9, topology="ring")  # doctest: +SKIP

    References:
        Lian et al., "Can Decentralized Algorithms Outperform Centralized Algorithms?", NeurIPS 2017.
    """

    rule = SgdRule()

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        **options: Unpack[Options],
    ) -> None:
        def hyper() -> dict[str, object]:
            check_lr(lr)
            check_momentum(momentum, dampening, nesterov)
            check_weight_decay(weight_decay)
            more = dict(weight_decay=weight_decay, nesterov=nesterov)
            return dict(lr=lr, momentum=momentum, dampening=dampening, **more)

        super().__init__(params, hyper, **options)

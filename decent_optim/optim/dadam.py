"""DecentralizedAdam and DecentralizedAdamW: torch's Adam/AdamW step on mixed parameters."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from decent_optim._validation import adam_hyper
from decent_optim.optim.engine import DecentralizedOptimizer
from decent_optim.optim.options import Options, ParamsT
from decent_optim.rules.adam import AdamRule

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["DecentralizedAdam", "DecentralizedAdamW"]


class DecentralizedAdam(DecentralizedOptimizer):
    r"""Adam whose parameters are also averaged with the topology's neighbours (combine, then adapt).

    .. math::
        \tilde x_i = \textstyle\sum_j W^{(t)}_{ij}\, x_j, \qquad
        m \leftarrow \beta_1 m + (1-\beta_1)\, g_i, \qquad
        v \leftarrow \beta_2 v + (1-\beta_2)\, g_i^2, \qquad
        x_i \leftarrow \tilde x_i - \eta\, \frac{m / (1-\beta_1^t)}{\sqrt{v / (1-\beta_2^t)} + \epsilon}

    with :math:`g_i = \nabla f(x_i;\ \xi_i) + \lambda \tilde x_i` (L2 decay of the mixed values) or,
    with ``decoupled_weight_decay``, :math:`g_i = \nabla f(x_i;\ \xi_i)` and :math:`\tilde x_i`
    first scaled by :math:`1 - \eta\lambda` (AdamW). The neighbours' :math:`x_j` travel while the
    next forward and backward run. With one worker :math:`W=[1]` and this is exactly
    :class:`torch.optim.Adam`.
    It wants a larger learning rate than All-Reduce (1.5-2x in the docs' "Getting All-Reduce
    quality"); when many workers share a fixed global batch and the local batch gets small, use
    :class:`AccumAdam` with ``accum_iter`` = the number of workers, up to 8.

    Args:
        params: parameters or param groups, as for :class:`torch.optim.Adam`.
        lr, betas, eps, weight_decay, amsgrad, decoupled_weight_decay: as for
            :class:`torch.optim.Adam`.
        options: ``topology``, ``process_group``, ... and torch.optim's flags (``maximize``,
            ...): see :class:`~decent_optim.DecentralizedOptimizer`.

    Example:
        >>> opt = DecentralizedAdam(model.parameters(), lr=1e-3, topology="one-peer-exp")  # doctest: +SKIP

    References:
        Wang, Zhang, Wu, Johansson, "From Promise to Practice: Realizing High-performance
        Decentralized Training", ICLR 2025 (Algorithm 1).
    """

    rule = AdamRule()

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        decoupled_weight_decay: bool = False,
        **options: Unpack[Options],
    ) -> None:
        def hyper() -> dict[str, object]:
            decoupled = decoupled_weight_decay
            return adam_hyper(
                lr, betas, eps, weight_decay, amsgrad, decoupled_weight_decay=decoupled
            )

        super().__init__(params, hyper, **options)


class DecentralizedAdamW(DecentralizedAdam, weight_decay=1e-2, decoupled_weight_decay=True):
    r"""AdamW (decoupled weight decay) on parameters averaged with the topology's neighbours.

    .. math::
        x_i \leftarrow \mathrm{AdamStep}\Big((1 - \eta\lambda) \textstyle\sum_j W^{(t)}_{ij}\, x_j,\;
        \nabla f(x_i;\ \xi_i)\Big)

    The drop-in replacement for :class:`torch.optim.AdamW` (same arguments and defaults, plus the
    options of :class:`~decent_optim.DecentralizedOptimizer`); with one worker it is exactly
    :class:`torch.optim.AdamW`. This is :class:`DecentralizedAdam` with ``weight_decay=1e-2`` and
    ``decoupled_weight_decay=True`` by default.

    Example:
        >>> opt = DecentralizedAdamW(model.parameters(), lr=3e-4, weight_decay=0.1,
        ...                          topology="one-peer-exp")  # doctest: +SKIP
    """

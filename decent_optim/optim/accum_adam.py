"""AccumAdam and AccumAdamW: Adam whose moment estimates are refreshed every few steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

from decent_optim._validation import adam_hyper, check_accum_iter
from decent_optim.optim.engine import DecentralizedOptimizer
from decent_optim.optim.options import Options, ParamsT
from decent_optim.rules.accum_adam import AccumAdamRule

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["AccumAdam", "AccumAdamW"]


class AccumAdam(DecentralizedOptimizer):
    r"""Decentralized Adam for small local batches: moment bases refreshed every ``accum_iter`` steps.

    .. math::
        m_t = \beta_1 \bar m + (1-\beta_1) g_t, \quad v_t = \beta_2 \bar v + (1-\beta_2) g_t^2,
        \quad x_i \leftarrow \tilde x_i - \eta \frac{m_t / (1-\beta_1^k)}{\sqrt{v_t/(1-\beta_2^k)} + \epsilon}

    where :math:`\tilde x_i = \sum_j W^{(t)}_{ij} x_j` is the mixed parameter and
    :math:`k = \lceil t / s \rceil`, :math:`s` = ``accum_iter``. A parameter step is taken every
    iteration, but the bases :math:`\bar m, \bar v` move only every :math:`s` steps, by the mean
    gradient of those steps: the moments see an effective batch :math:`s` times larger. Weight
    decay is L2 (``weight_decay * x`` joins the gradient), or decoupled as in AdamW with
    ``decoupled_weight_decay``. With ``accum_iter=1`` this is Adam, and with one worker exactly
    :class:`torch.optim.Adam`.

    ``accum_iter`` grows with the number of workers sharing a fixed global batch: the number of
    workers, up to 8 (1 is Adam, for large local batches). The bases remember about
    ``accum_iter / (1 - beta1)`` steps: warm the learning rate up for at least three times that,
    and raise ``beta2`` a little (``(0.9, 0.98)`` where AdamW would use ``(0.9, 0.95)``) rather
    than raising the betas to the power ``accum_iter``. Docs: "Getting All-Reduce quality".

    The state keys ``exp_avg`` and ``exp_avg_sq`` hold :math:`\bar m` and :math:`\bar v`;
    ``grad_acc`` holds the running mean gradient of the current window. ``fused`` (see
    :class:`~decent_optim.DecentralizedOptimizer`) compiles the step into one pass over memory.

    Args:
        params: parameters or param groups, as for :class:`torch.optim.Adam`.
        lr, betas, eps, weight_decay, amsgrad, decoupled_weight_decay: as for
            :class:`torch.optim.Adam`.
        accum_iter: steps per refresh of the moment bases (the paper's :math:`s`).
        options: see :class:`~decent_optim.DecentralizedOptimizer`.

    Example:
        >>> opt = AccumAdam(model.parameters(), lr=2e-3, betas=(0.9, 0.98),
        ...                 accum_iter=min(world_size, 8), topology="ring")  # doctest: +SKIP

    References:
        Wang, Zhang, Wu, Johansson, "From Promise to Practice: Realizing High-performance
        Decentralized Training", ICLR 2025.
    """

    rule = AccumAdamRule()

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        accum_iter: int = 4,
        decoupled_weight_decay: bool = False,
        **options: Unpack[Options],
    ) -> None:
        def hyper() -> dict[str, object]:
            check_accum_iter(accum_iter)
            decoupled = decoupled_weight_decay
            more = dict(accum_iter=accum_iter, decoupled_weight_decay=decoupled)
            return adam_hyper(lr, betas, eps, weight_decay, amsgrad, **more)

        super().__init__(params, hyper, **options)


class AccumAdamW(AccumAdam, weight_decay=1e-2, decoupled_weight_decay=True):
    r"""AccumAdam with decoupled weight decay, as AdamW is to Adam.

    The mixed parameter is first multiplied by :math:`1 - \eta\lambda`, then takes the AccumAdam
    step of :class:`AccumAdam`. This is :class:`AccumAdam` with ``weight_decay=1e-2``
    (torch.optim.AdamW's default) and ``decoupled_weight_decay=True`` by default.
    """

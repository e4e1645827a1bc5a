"""User-given schedules: :class:`CustomTopology` reads and validates doubly stochastic rounds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from decent_optim.topologies.base import Topology, second_singular_value

__all__ = ["CustomTopology"]

_TOL = 1e-6  # tolerance for row/column sums of user-given matrices


class CustomTopology(Topology):
    """A user-given periodic schedule of doubly stochastic matrices.

    Each round is an ``(n, n)`` matrix (tensor or nested lists) or a list of ``n`` rows given as
    ``{source: weight}`` dicts. The schedule is validated: square, one size for all rounds,
    non-negative, rows and columns summing to 1 (within 1e-6), and the product over one period
    must mix (second singular value < 1), otherwise the workers would never agree.

    Example::

        # a path 0 - 1 - 2 with Metropolis weights, the same every round
        w = [[2/3, 1/3, 0], [1/3, 1/3, 1/3], [0, 1/3, 2/3]]
        topo = CustomTopology([w])
    """

    def __init__(
        self,
        schedule: Sequence[
            torch.Tensor | Sequence[Sequence[float]] | Sequence[Mapping[int, float]]
        ],
        local_world_size: int = 1,
    ) -> None:
        if isinstance(schedule, torch.Tensor) or not isinstance(schedule, Sequence) or not schedule:
            raise ValueError(
                "schedule must be a non-empty list of rounds (matrices or lists of row dicts); "
                f"got {type(schedule).__name__}"
            )
        matrices = [_to_matrix(r, rnd) for r, rnd in enumerate(schedule)]
        n = matrices[0].shape[0]
        for r, m in enumerate(matrices):
            _validate_round(r, m, n)
        super().__init__(n, local_world_size)
        self._matrices = matrices
        if n > 1:
            sigma2 = second_singular_value(self.period_product())
            if sigma2 >= 1 - 1e-9:
                raise ValueError(
                    "schedule does not mix: the product of its rounds has second singular value "
                    f"{sigma2:.6g} (must be < 1); some workers never exchange values"
                )

    @property
    def period(self) -> int:
        return len(self._matrices)

    def _round_matrix(self, r: int) -> torch.Tensor:
        return self._matrices[r]


def _to_matrix(r: int, rnd: object) -> torch.Tensor:
    if isinstance(rnd, torch.Tensor):
        m = rnd.detach().to(device="cpu", dtype=torch.float64)
    elif isinstance(rnd, Sequence) and rnd and all(isinstance(row, Mapping) for row in rnd):
        n = len(rnd)
        m = torch.zeros(n, n, dtype=torch.float64)
        for i, row in enumerate(rnd):
            for j, w in row.items():
                if not (isinstance(j, int) and 0 <= j < n):
                    raise ValueError(
                        f"round {r}: row {i} names source {j!r}, expected a rank in [0, {n})"
                    )
                m[i, j] = float(w)
    else:
        try:
            m = torch.tensor(rnd, dtype=torch.float64)
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"round {r}: cannot read a matrix from {type(rnd).__name__}: {err}"
            ) from None
    if m.dim() != 2 or m.shape[0] != m.shape[1] or m.shape[0] == 0:
        raise ValueError(
            f"round {r}: mixing matrix must be square (n, n), got shape {tuple(m.shape)}"
        )
    return m


def _validate_round(r: int, m: torch.Tensor, n: int) -> None:
    if m.shape[0] != n:
        raise ValueError(f"round {r}: matrix is {m.shape[0]}x{m.shape[0]}, but round 0 is {n}x{n}")
    if not torch.isfinite(m).all():
        raise ValueError(f"round {r}: mixing matrix has non-finite entries")
    if (m < 0).any():
        i, j = (int(k) for k in torch.nonzero(m < 0)[0])
        raise ValueError(f"round {r}: entry ({i}, {j}) is {float(m[i, j]):g}, weights must be >= 0")
    for axis, what in ((1, "row"), (0, "column")):
        sums = m.sum(dim=axis)
        bad = torch.nonzero((sums - 1).abs() > _TOL).flatten()
        if bad.numel():
            k = int(bad[0])
            raise ValueError(
                f"round {r}: {what} {k} sums to {float(sums[k]):.6g}, expected 1 "
                "(mixing matrices must be doubly stochastic)"
            )

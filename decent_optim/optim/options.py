"""The keyword arguments every decentralized optimizer takes besides its algorithm's own.

They are defined here once, as :class:`Options`, and documented once, on
:class:`~decent_optim.DecentralizedOptimizer`; each public class passes them through as
``**options``. :func:`with_defaults` lets a class be its parent with other defaults
(``DecentralizedAdamW`` is ``DecentralizedAdam`` with ``weight_decay=1e-2`` and decoupled decay).
"""

from __future__ import annotations

import datetime
import inspect
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypedDict

from decent_optim.topologies import Topology

if TYPE_CHECKING:
    from decent_optim.gossip.codec_base import Codec
    from decent_optim.optim.local_steps import Periods
    from decent_optim.optim.schedules import Uneven

__all__ = ["Options", "ParamsT", "with_defaults"]

#: what ``params`` may be, as for torch.optim: tensors, (name, tensor) pairs, or param group dicts
ParamsT = Any


class Options(TypedDict, total=False):
    """The shared keyword arguments; see :class:`~decent_optim.DecentralizedOptimizer`."""

    topology: str | Topology
    process_group: Any
    bucket_cap_mb: float
    local_world_size: int | None
    timeout: float | datetime.timedelta | None
    global_avg_every: int | None
    maximize: bool
    foreach: bool | None
    capturable: bool
    differentiable: bool
    fused: bool | None
    compression: str | Codec | None
    local_steps: int | Periods
    outer: Any
    uneven: bool | Uneven
    membership: Any
    on_membership_change: Any


def with_defaults(
    init: Callable[..., None], qualname: str, defaults: dict[str, Any]
) -> Callable[..., None]:
    """A copy of the function ``init`` whose parameters named in ``defaults`` default to those values.

    The copy shares ``init``'s code (so ``super()`` inside it still names ``init``'s class) and
    carries real defaults, so ``inspect.signature``, help() and the docs show them.
    """
    params = inspect.signature(init).parameters
    unknown = sorted(set(defaults) - set(params))
    if unknown:
        raise TypeError(f"{qualname}: no parameter named {', '.join(unknown)} to give a default")
    positional = [
        p.name
        for p in params.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is not p.empty
    ]
    new = types.FunctionType(
        init.__code__,
        init.__globals__,
        init.__name__,
        tuple(defaults.get(name, params[name].default) for name in positional),
        init.__closure__,
    )
    new.__kwdefaults__ = {
        **(init.__kwdefaults__ or {}),
        **{k: v for k, v in defaults.items() if params[k].kind is inspect.Parameter.KEYWORD_ONLY},
    }
    new.__annotations__ = dict(init.__annotations__)
    new.__qualname__ = qualname
    new.__doc__ = init.__doc__
    return new

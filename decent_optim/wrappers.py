"""Our optimizer from inside the wrappers that training frameworks put around it.

``accelerator.prepare`` hands back an ``AcceleratedOptimizer``, Lightning a ``LightningOptimizer``,
torch's ``PostLocalSGDOptimizer`` wraps another optimizer too. They forward ``step``,
``zero_grad`` and ``state_dict`` but not this package's own methods (:meth:`averaged`,
:meth:`synchronize`, :meth:`consensus_distance`, ...): :func:`unwrap` finds the optimizer that has
them.
"""

from __future__ import annotations

from typing import Any

from decent_optim.optim.engine import DecentralizedOptimizer

__all__ = ["unwrap"]

#: where wrappers keep the optimizer they wrap: accelerate (``optimizer``), Lightning
#: (``_optimizer``, also its ``optimizer`` property), torch's PostLocalSGDOptimizer (``optim``)
_INNER = ("optimizer", "_optimizer", "optim")
#: wrappers of wrappers are followed this deep (a guard against a cycle)
_MAX_DEPTH = 16


def unwrap(optimizer: Any) -> DecentralizedOptimizer:
    """The decentralized optimizer inside framework wrappers, or ``optimizer`` itself.

    Example:
        >>> model, opt = accelerator.prepare(model, opt)  # doctest: +SKIP
        >>> with decent_optim.unwrap(opt).averaged(model):  # doctest: +SKIP
        ...     evaluate(model)

    Raises:
        TypeError: there is no :class:`~decent_optim.DecentralizedOptimizer` inside.
    """
    found = optimizer
    for _ in range(_MAX_DEPTH):
        # Lightning's wrapper is also an instance of the wrapped class (for isinstance checks)
        # without its attributes, so the wrapped object is looked for first
        inner = next(
            (x for x in (getattr(found, name, None) for name in _INNER) if _is_inner(x, found)),
            None,
        )
        if inner is None:
            break
        found = inner
    if isinstance(found, DecentralizedOptimizer):
        return found
    inside = "" if found is optimizer else f" (it holds a {type(found).__name__})"
    raise TypeError(
        "unwrap expects a decent_optim optimizer or a wrapper around one (e.g. accelerate's "
        f"AcceleratedOptimizer), got a {type(optimizer).__name__}{inside}; pass the object "
        "that accelerator.prepare or the trainer returned for a decent_optim optimizer"
    )


def _is_inner(candidate: Any, wrapper: Any) -> bool:
    return (
        candidate is not None
        and candidate is not wrapper
        and callable(getattr(candidate, "step", None))
    )

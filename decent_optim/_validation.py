"""Argument checks shared by every optimizer: one wording, checked before any side effect.

The hyper-parameter messages are torch.optim's own, so code that catches or matches them keeps
working after the swap.
"""

from __future__ import annotations

import datetime
import numbers
import os

from torch import Tensor

from decent_optim.topologies import Topology


def _number(name: str, value: object) -> float:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"Tensor {name} must be 1-element")
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def check_lr(lr: object) -> None:
    if not 0.0 <= _number("lr", lr):
        raise ValueError(f"Invalid learning rate: {lr}")


def check_eps(eps: object) -> None:
    if not 0.0 <= _number("eps", eps):
        raise ValueError(f"Invalid epsilon value: {eps}")


def check_weight_decay(weight_decay: object) -> None:
    if not 0.0 <= _number("weight_decay", weight_decay):
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def check_betas(betas: object) -> None:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        if not 0.0 <= _number(f"betas[{i}]", beta) < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta}")


def adam_hyper(
    lr: object, betas: object, eps: object, weight_decay: object, amsgrad: bool, **more: object
) -> dict[str, object]:
    """The checked hyper-parameters of the Adam family, as a param group's defaults."""
    check_lr(lr)
    check_eps(eps)
    check_betas(betas)
    check_weight_decay(weight_decay)
    pair = (float(betas[0]), float(betas[1]))  # type: ignore[index]
    return dict(lr=lr, betas=pair, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, **more)


def check_momentum(momentum: object, dampening: object, nesterov: bool) -> None:
    if not 0.0 <= _number("momentum", momentum):
        raise ValueError(f"Invalid momentum value: {momentum}")
    _number("dampening", dampening)
    if nesterov and (momentum <= 0 or dampening != 0):  # type: ignore[operator]
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")


def check_accum_iter(accum_iter: object) -> None:
    if isinstance(accum_iter, bool) or not isinstance(accum_iter, numbers.Integral):
        raise TypeError(f"accum_iter must be an int, got {type(accum_iter).__name__}")
    if accum_iter < 1:
        raise ValueError(f"accum_iter must be >= 1, got {accum_iter}")


def check_unsupported(cls_name: str, **flags: object) -> None:
    """torch.optim flags this package does not implement must be left at their defaults."""
    for name, value in flags.items():
        if value:
            raise ValueError(
                f"{cls_name} does not support {name}={value!r}; leave it at its default"
            )


def check_decentralized(
    topology: object, bucket_cap_mb: object, local_world_size: object, compression: object = None
) -> None:
    if not isinstance(topology, (str, Topology)):
        raise TypeError(
            f"topology must be a name (str) or a decent_optim.Topology, got {type(topology).__name__}"
        )
    if not _number("bucket_cap_mb", bucket_cap_mb) > 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
    if local_world_size is not None and (
        isinstance(local_world_size, bool)
        or not isinstance(local_world_size, numbers.Integral)
        or local_world_size < 1
    ):
        raise ValueError(
            f"local_world_size must be a positive int or None, got {local_world_size!r}"
        )
    check_compression(compression)


def check_compression(compression: object) -> None:
    """None, a gossip codec or its name (:func:`decent_optim.gossip.codecs.get` raises)."""
    if compression is None:
        return
    from decent_optim.gossip.codecs import get

    get(compression)  # type: ignore[arg-type]


def resolve_local_world_size(local_world_size: int | None) -> int:
    """The explicit value, else torchrun's LOCAL_WORLD_SIZE, else 1."""
    if local_world_size is not None:
        return local_world_size
    env = os.environ.get("LOCAL_WORLD_SIZE", "1")
    try:
        value = int(env)
    except ValueError:
        raise ValueError(
            f"environment variable LOCAL_WORLD_SIZE must be an int, got {env!r}"
        ) from None
    if value < 1:
        raise ValueError(f"environment variable LOCAL_WORLD_SIZE must be >= 1, got {value}")
    return value


def check_timeout(timeout: object) -> datetime.timedelta | None:
    """``None``, seconds (> 0) or a positive ``timedelta``; returned as a timedelta."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    else:
        seconds = _number("timeout", timeout)
    if not seconds > 0:
        raise ValueError(f"timeout must be > 0 seconds (a float or a timedelta), got {timeout!r}")
    return datetime.timedelta(seconds=seconds)


def check_global_avg_every(every: object) -> None:
    if every is None:
        return
    if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 1:
        raise ValueError(f"global_avg_every must be a positive int (steps) or None, got {every!r}")

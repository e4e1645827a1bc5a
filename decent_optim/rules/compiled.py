"""Update math compiled into one pass over memory by ``torch.compile``, with an eager fallback.

Some steps have no single torch kernel: AccumAdam reads the moment bases, the gradient and the
accumulator and writes the parameter and the accumulator, which eager torch does in several
passes over memory. Written once in tensor operations, the same math compiled by inductor (a C++
loop on CPUs, a Triton kernel on GPUs) moves each element once, and can add a peer's values for
the round's mix in the same pass.

:class:`CompiledStep` compiles on first use in the process, with dynamic shapes and scalars
(``dynamic=True``): later steps, other buckets and scheduled learning rates reuse the kernel.
Compiling costs a few seconds once per process (longer on a machine that never compiled it; the
result is cached on disk). If it fails -- no C++ compiler on a CPU machine, an unsupported
platform -- a warning says so once and the caller's eager path serves from then on.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["COMPILE_FROM_NUMEL", "CompiledStep"]

#: With ``fused=None`` a bucket's update is compiled only from this many elements on: below it the
#: pass it saves costs less than the compile (seconds, once per process).
COMPILE_FROM_NUMEL = 1 << 20


class CompiledStep:
    """``fn`` compiled on first use; :meth:`run` reports whether the compiled form ran."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self._fn = fn
        self._compiled: Callable[..., None] | None = None
        self._failed: set[str] = set()  # device types on which compiling failed

    def usable(self, fused: bool | None, device: torch.device, numel: int) -> bool:
        """Whether to try the compiled form for a bucket of ``numel`` elements on ``device``.

        ``fused`` is the param group's flag: False never, True always, None from
        :data:`COMPILE_FROM_NUMEL` elements on. Never while tracing (the caller's graph takes the
        plain math), and never again on a device type where compiling failed.
        """
        if fused is False or torch.compiler.is_compiling():
            return False
        if device.type not in ("cpu", "cuda") or device.type in self._failed:
            return False
        return fused is True or numel >= COMPILE_FROM_NUMEL

    def run(self, device: torch.device, *args: Any, **kwargs: Any) -> bool:
        """Call the compiled ``fn``; False, with nothing written, if it could not be compiled."""
        if self._compiled is None:
            self._compiled = torch.compile(self._fn, dynamic=True)
        try:
            self._compiled(*args, **kwargs)
        except Exception as err:
            from torch._dynamo.exc import TorchDynamoException

            # compile errors arrive before the kernel runs, so nothing was written yet
            if not isinstance(err, TorchDynamoException):
                raise
            self._failed.add(device.type)
            warnings.warn(
                f"decent_optim could not compile its one-pass update kernel for {device.type} "
                f"({type(err).__name__}: {str(err).splitlines()[0]}); using the eager kernels, "
                "which move more memory per step. Pass fused=False to the optimizer to skip the "
                "attempt.",
                RuntimeWarning,
                stacklevel=4,
            )
            return False
        return True

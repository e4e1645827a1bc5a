"""Emulated devices: each step of a rank takes a set device time, whatever the cores are doing.

On a shared 2-core machine the ranks' real compute depends on how the cores are shared, so a
benchmark of uneven hardware cannot come from real compute. Instead every step is padded by a
sleep to an emulated device time, taken before any communication of the step (a pad after a
wait for other ranks would hide the wait):

    device time of rank r's step s = device_ms / speed[r] * jitter(seed, r, s)

``jitter`` is 1, or a log-normal factor of mean 1 and coefficient of variation ``jitter_cv``
(the sigma of the paper's runtime model), drawn from a generator seeded by (seed, rank, step), so
every method sees the same device times. The sleep is the device time less the rank's real
compute of this very step (``pad(step, spent)``, called after forward and backward and before
the step's communication), so a step takes its device time whatever the other ranks' processes
do to the shared cores; where the compute cannot be separated from communication (Decent-DP's
hooks) the sleep comes at the start of the step, less a compute time measured once
(``calibrate``). Waits for other ranks stay inside the clock. ``device_ms=0`` turns it off
(real compute only).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections.abc import Callable


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device-ms",
        type=float,
        default=0.0,
        help="emulated device time per step of a speed-1 rank (0: off)",
    )
    p.add_argument(
        "--speeds",
        default="",
        help="per-rank speed factors, comma-separated (1,1,1,0.5: rank 3 at half "
        "speed); default all 1",
    )
    p.add_argument("--jitter-cv", type=float, default=0.0,
                   help="coefficient of variation of each step's device time (log-normal)")  # fmt: skip


def regime_rate(params: int, device_ms: float, regime: float) -> str:
    """The per-node link rate, in tc syntax, at which one fp32 copy of ``params`` values takes
    ``regime`` device steps of ``device_ms`` to cross: ``8 * 4 * params / (R * device_s)``
    bit/s (issue 40's R: 0.3 a data-centre fabric, 3 a 124M-1B model over 10 Gbit/s, 30 a 1B
    model over 1 Gbit/s, 300 a 10B model over 1 Gbit/s)."""
    if regime <= 0 or device_ms <= 0:
        raise SystemExit(
            "a regime needs --regime R > 0 and --device-ms > 0 (the step it counts in)"
        )
    return f"{max(1, round(32 * params / (regime * device_ms / 1e3) / 1e3))}kbit"


def speeds_of(spec: str | None, world_size: int) -> list[float]:
    if not spec or spec == "None":
        return [1.0] * world_size
    speeds = [float(s) for s in spec.split(",")]
    if len(speeds) != world_size or not all(s > 0 for s in speeds):
        raise SystemExit(f"--speeds needs {world_size} positive factors, got {spec!r}")
    return speeds


def describe(args) -> str:
    """One line for a results table: what the emulated devices were."""
    if not args.device_ms:
        return "real compute (no emulated device time)"
    text = f"emulated device time {args.device_ms:g} ms per step"
    if args.speeds and any(float(s) != 1 for s in args.speeds.split(",")):
        text += f", speeds {args.speeds}"
    if args.jitter_cv:
        text += f", jitter CV {args.jitter_cv:g}"
    return text


class Device:
    """The emulated device of one rank: :meth:`pad` at the start of every step."""

    def __init__(self, args, rank: int, world_size: int) -> None:
        self.ms = args.device_ms / speeds_of(args.speeds, world_size)[rank]
        self.cv, self.seed, self.rank = args.jitter_cv, args.seed, rank
        self.compute_s = 0.0
        sigma2 = math.log1p(self.cv**2)  # log-normal with mean 1 and this CV
        self._sigma, self._mu = math.sqrt(sigma2), -sigma2 / 2

    @property
    def on(self) -> bool:
        return self.ms > 0

    def calibrate(self, one_step: Callable[[], None], repeats: int = 7) -> float:
        """Median seconds of ``one_step`` (forward + backward, no communication)."""
        if not self.on:
            return 0.0
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            one_step()
            times.append(time.perf_counter() - t0)
        self.compute_s = statistics.median(times)
        return self.compute_s

    def step_s(self, step: int) -> float:
        """The emulated device time of ``step``, in seconds."""
        factor = 1.0
        if self.cv:
            rng = random.Random(self.seed * 1_000_003 + self.rank * 10_007 + step + 7)
            factor = math.exp(rng.gauss(self._mu, self._sigma))
        return self.ms * factor / 1e3

    def pad(self, step: int, spent: float | None = None) -> None:
        """Sleep for this step's device time less its real compute: ``spent`` seconds already
        taken by it, or (``None``) the calibrated compute that is still to follow."""
        if self.on:
            done = self.compute_s if spent is None else spent
            time.sleep(max(0.0, self.step_s(step) - done))

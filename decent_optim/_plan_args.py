"""The command line of ``python -m decent_optim.plan``: its options, their checks, its help."""

from __future__ import annotations

import argparse
import math
from typing import Any

from decent_optim import topologies
from decent_optim.runtime import regimes, wire

__all__ = ["LAUNCH", "parse", "parser"]

#: how to launch it, for --help and for the error when it was not launched that way
LAUNCH = (
    "Run it under torchrun, with the node layout of the real job: on one machine\n"
    "  torchrun --standalone --nproc-per-node 4 -m decent_optim.plan --params 65e6\n"
    "and on several, the same command on every machine with --nnodes N and a rendezvous\n"
    "endpoint (--rdzv-backend c10d --rdzv-endpoint HOST:PORT) instead of --standalone."
)


def _number(kind: type, low: float, strict: bool) -> Any:
    """An argparse type: a ``kind`` number ``> low`` (``strict``) or ``>= low``."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be finite, got {text}")
        if not (value > low if strict else value >= low):
            raise argparse.ArgumentTypeError(
                f"must be {'>' if strict else '>='} {low:g}, got {text}"
            )
        return value

    return parse


def _topology_name(text: str) -> str:
    if text not in topologies.names():
        valid = ", ".join(topologies.names())
        raise argparse.ArgumentTypeError(f"unknown topology {text!r}; valid names are {valid}")
    return text


def _compression_name(text: str) -> str:
    try:
        wire.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _link(text: str) -> float:
    try:
        return regimes.link_bits(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def parser() -> argparse.ArgumentParser:
    """Every option, each with its help."""
    p = argparse.ArgumentParser(
        prog="python -m decent_optim.plan",
        description="Measure this cluster and predict which method trains fastest.\nIt must run "
        "under torchrun, in every process of the job (see the end of this help).",
        epilog=LAUNCH
        + "\n\nTopologies that do not fit the world size are left out, with the reason printed\n"
        "under the table: one-peer-exp needs a power-of-two number of workers,\n"
        "alternating-exp-ring a power-of-two number of nodes (at least 2).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    positive_int, positive = _number(int, 0, True), _number(float, 0, True)
    at_least_0 = _number(float, 0, False)
    for flag, kind, default, about in [
        ("--params", positive, None, "model size in parameters (default 10M; given with --link)"),
        ("--layers", positive_int, 4, "square layers of the synthetic workload (default 4)"),
        ("--batch", positive_int, 64, "rows per forward of the synthetic workload (default 64)"),
        ("--iters", positive_int, 10, "timed compute iterations per rank (default 10)"),
        ("--reps", positive_int, 3, "timed repetitions of each communication (default 3)"),
        ("--compute-ms", positive, None, "your model's forward+backward ms, instead of ours"),
        ("--compute-std-ms", at_least_0, 0.0, "its standard deviation in ms (with --compute-ms)"),
        ("--overlap", at_least_0, 1.0, "share of DDP's all-reduce backward hides, 0-1 (default 1)"),
    ]:
        p.add_argument(flag, type=kind, default=default, help=about)
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the parameters and of what is exchanged (default float32)",
    )
    p.add_argument(
        "--topologies",
        nargs="+",
        type=_topology_name,
        default=topologies.names(),
        help=f"topologies to measure (default: all that fit: {', '.join(topologies.names())})",
    )
    p.add_argument(
        "--compression",
        nargs="*",
        default=[],
        type=_compression_name,
        help="also measure the topologies' rounds compressed this way (several nodes only): "
        + wire.names_help().replace("%", "%%"),  # argparse formats help with %
    )
    p.add_argument(
        "--r",
        type=_number(float, 0, True),
        default=None,
        metavar="R",
        help="seconds one float32 copy of the model takes over a node's uplink / seconds per "
        "step: print which compression keeps a round hidden at R (with --local-steps, per H; "
        "the --compression names, else a list of candidates) and the line to write "
        "(decent_optim.recommend); without torchrun only that",
    )
    p.add_argument(
        "--link",
        type=_link,
        default=None,
        metavar="RATE",
        help="with --params and --step-ms instead of --r: a node's uplink in bits per second "
        "(100mbit, 1gbit, 10gbit); R = 32 x params / bits per second / seconds per step, on "
        "float32 copies whatever --dtype and --compression say",
    )
    p.add_argument(
        "--step-ms",
        type=positive,
        default=None,
        metavar="S",
        help="with --params and --link: device milliseconds of one training step",
    )
    p.add_argument(
        "--local-steps",
        nargs="*",
        type=positive_int,
        default=[],
        metavar="H",
        help="also predict gossip every H steps (local_steps=H) and DiLoCo's all-reduce every H",
    )
    p.add_argument(
        "--speeds",
        nargs="+",
        type=positive,
        default=None,
        metavar="S",
        help="one speed factor per worker (1 1 1 0.5: the last at half speed): predict every "
        "method on workers that uneven, and uneven=True with --local-steps",
    )
    p.add_argument(
        "--nodes",
        type=positive_int,
        default=None,
        metavar="N",
        help="machines in the job, for the line to write (under torchrun: measured)",
    )
    p.add_argument(
        "--workers-per-node",
        type=positive_int,
        default=None,
        metavar="W",
        help="workers (GPUs) per machine, for the line to write (under torchrun: measured)",
    )
    p.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        metavar="T",
        help="the schedule's length in steps: at slow links it decides between every-step "
        "int8 (short) and local steps with an outer step (long)",
    )
    p.add_argument(
        "--failures",
        action="store_true",
        help="the job must survive lost workers: the line adds live membership",
    )
    p.add_argument("--json", default=None, help="also write the measurements and predictions here")
    return p


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The options of ``argv``; a usage error (exit 2) naming the option for a bad value."""
    p = parser()
    args = p.parse_args(argv)
    args.ratio_text = None
    parts = {"--link": args.link, "--step-ms": args.step_ms}
    if any(v is not None for v in parts.values()):
        if args.r is not None:
            p.error(
                "pick one: --r R, or --params N --link RATE --step-ms S to compute R from its parts"
            )
        missing = [flag for flag, v in {"--params": args.params, **parts}.items() if v is None]
        if missing:
            needs = "R from its parts needs --params N --link RATE --step-ms S"
            p.error(f"{needs}; add {' '.join(missing)}")
        step_s = args.step_ms / 1e3
        try:
            args.r = regimes.ratio(args.params, args.link, step_s)
        except ValueError as err:
            p.error(str(err))
        args.ratio_text = regimes.ratio_text(args.params, args.link, step_s)
    if args.params is None:
        args.params = 10e6
    if args.overlap > 1:
        p.error(f"argument --overlap: must be in [0, 1], got {args.overlap:g}")
    if args.params < args.layers:
        p.error(
            f"argument --params: the workload needs at least one parameter per layer, got "
            f"--params {args.params:g} for --layers {args.layers}"
        )
    return args


#: recommend()'s argument names as the plan's flags, for its errors
_FLAGS = {"params=": "--params", "link=": "--link", "step_ms=": "--step-ms", "r=": "--r",
          "speeds": "--speeds", "nodes x workers_per_node": "--nodes x --workers-per-node"}  # fmt: skip


def wants_advice(args: argparse.Namespace) -> bool:
    """Whether the options say anything :func:`decent_optim.recommend` needs."""
    layout = (args.nodes, args.workers_per_node, args.speeds, args.steps)
    return args.r is not None or args.failures or any(v is not None for v in layout)


def advice_text(
    args: argparse.Namespace,
    nodes: int | None = None,
    per_node: int | None = None,
    strict: bool = False,
) -> str:
    """:func:`decent_optim.recommend` for these options (the layout measured under torchrun
    unless ``--nodes`` / ``--workers-per-node`` say otherwise), or why it cannot say: with
    ``strict`` a usage error (exit 2) instead."""
    from decent_optim.advice import recommend

    nodes = args.nodes if args.nodes is not None else nodes
    per_node = args.workers_per_node or per_node or 1
    try:
        advice = recommend(
            r=args.r,
            nodes=nodes,
            workers_per_node=per_node,
            speeds=args.speeds,
            failures=args.failures,
            steps=args.steps,
        )
    except (TypeError, ValueError) as err:
        text = str(err).replace("recommend(): ", "")
        for name, flag in _FLAGS.items():
            text = text.replace(name, flag)
        if strict:
            parser().error(text)
        return f"the line to write: not decided: {text}"
    layout = "several nodes" if nodes is None else f"{nodes} node(s) x {per_node} worker(s)"
    return f"for {layout}:\n{advice.text()}"

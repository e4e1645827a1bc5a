"""The membership store as a service: a ``TCPStore`` served by a process that trains nothing.

Live membership (:mod:`decent_optim.gossip.membership`) agrees on every change through a store
that must outlive every worker, so no worker may host it. ``python -m decent_optim.store --port
P`` (:mod:`decent_optim.store`) serves one on this host until it is sent SIGTERM or SIGINT (then
it exits 0); workers open it as ``dist.TCPStore(HOST, P, is_master=False)``, or pass
``HOST:P`` to :func:`decent_optim.gossip.torchrun.membership`. Run it on a host that does not
train (a login or scheduler node), or on the node least likely to fail: the store is a single
point of failure for changes of membership (not for training: a member that loses it trains on
with membership off, :mod:`~decent_optim.gossip.membership_store`).
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType

import torch.distributed as dist

__all__ = ["main", "serve"]


def serve(host: str = "0.0.0.0", port: int = 0) -> dist.TCPStore:
    """A store on ``host:port`` (port 0: any free one) that lives as long as the object."""
    return dist.TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        use_libuv=True,
        timeout=datetime.timedelta(seconds=300),
    )


def _stop(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m decent_optim.store``: serve the membership store until SIGTERM or SIGINT."""
    parser = argparse.ArgumentParser(
        prog="python -m decent_optim.store",
        description="Serve live membership's store (a TCPStore) until SIGTERM or Ctrl-C.",
    )
    parser.add_argument("--port", type=int, required=True, help="TCP port (0: any free one)")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port-file", help="write the port served here once listening")
    args = parser.parse_args(argv)
    if not 0 <= args.port < 65536:
        parser.error(f"--port must be 0..65535, got {args.port}")
    try:
        store = serve(args.host, args.port)
    except (RuntimeError, OSError) as err:  # DistNetworkError: the port is taken, bad host
        print(
            f"decent_optim.store: cannot serve on {args.host}:{args.port}: {err}", file=sys.stderr
        )
        return 2
    signal.signal(signal.SIGTERM, _stop)
    if args.port_file:
        with open(args.port_file + ".tmp", "w") as f:
            f.write(str(store.port))
        os.replace(args.port_file + ".tmp", args.port_file)
    print(f"decent_optim.store: serving on {args.host}:{store.port}; Ctrl-C ends it", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    return 0

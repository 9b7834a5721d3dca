"""The lighthouse of ``--fault-tolerance live``: the store where the ranks meet, on a process of its own.

``python -m hetfair.live.lighthouse --port 29400`` serves a :class:`torch.distributed.TCPStore` until
SIGTERM or Ctrl-C. It holds no training state, only the membership rounds and heartbeats
(:mod:`hetfair.live.membership`), so it lives on a machine that stays (your own) and is the one part of
a live job that must not be lost. Every rank's ``--distributed-init-method tcp://HOST:PORT`` names it.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch.distributed as dist


def serve(port: int, host: str = "0.0.0.0") -> dist.TCPStore:
    """Start the store server on ``port`` (0: a free one; see ``.port``) and return it (it serves while referenced)."""
    return dist.TCPStore(host, port, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetfair.live.lighthouse",
                                     description="serve the membership store of a --fault-tolerance live job")
    parser.add_argument("--port", type=int, default=29400, help="TCP port to listen on (0: a free one)")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: every interface)")
    args = parser.parse_args(argv)
    try:
        store = serve(args.port, args.host)
    except (RuntimeError, dist.DistNetworkError) as exc:
        print(f"hetfair-lighthouse: error: cannot listen on port {args.port}: {str(exc).splitlines()[0]}",
              file=sys.stderr, flush=True)
        return 1
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    print(f"lighthouse | listening on port {store.port}", file=sys.stderr, flush=True)
    stop.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

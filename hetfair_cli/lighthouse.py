"""``hetfair-lighthouse``: serve the membership store of a ``--fault-tolerance live`` job."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any, Sequence

from hetfair.errors import ConfigError
from hetfair.launch.native_output import native_stderr_discarded, quiet_native_logs
from hetfair_cli.errors import run_cli


def build_parser() -> argparse.ArgumentParser:
    from hetfair.live.lighthouse import DEFAULT_HOST

    parser = argparse.ArgumentParser(prog="hetfair-lighthouse",
                                     description="serve the membership store of a --fault-tolerance live job "
                                                 "until SIGTERM or Ctrl-C")
    parser.add_argument("--port", type=int, default=29400, help="TCP port to listen on (0: a free one)")
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help=f"address to listen on (default: {DEFAULT_HOST}, only this machine; give this "
                             f"machine's address, or 0.0.0.0 for every interface, when ranks run elsewhere, and "
                             f"give every rank the job's HETFAIR_SECRET)")
    return parser


def _main(argv: list[str]) -> int:
    from hetfair.live.lighthouse import serve

    args = build_parser().parse_args(argv)
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port} is not a TCP port: give 1-65535, or 0 for a free one")
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    # the store's C++ warnings (a client address without a DNS name, a client gone) are no news here
    with native_stderr_discarded(enabled=quiet_native_logs()):
        store = serve(args.port, args.host)
        print(f"lighthouse | listening on port {store.port} ({args.host})", file=sys.stderr, flush=True)
        stop.wait()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("hetfair-lighthouse", _main, argv)


if __name__ == "__main__":
    raise SystemExit(main())

"""The lighthouse of ``--fault-tolerance live``: the store where the ranks meet, on a process of its own.

``hetfair-lighthouse --port 29400`` serves a :class:`torch.distributed.TCPStore` on the loopback
address until SIGTERM or Ctrl-C; ``--host ADDRESS`` serves it on that address (``0.0.0.0``: every
interface), for ranks on other machines. It holds no training state, only the membership rounds and
heartbeats (:mod:`hetfair.live.membership`), so it lives on a machine that stays (your own) and is the
one part of a live job that must not be lost. Every rank's ``--distributed-init-method tcp://HOST:PORT``
names it. It knows no secret: the ranks sign and hide their own records (:mod:`hetfair.live.records`).
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

from hetfair.errors import ConfigError, DistributedError, first_line
from hetfair.launch.rendezvous import listening_socket

DEFAULT_HOST = "127.0.0.1"
"""Where the lighthouse listens unless told: only this machine's ranks reach it."""


def resolve(host: str) -> str:
    """``host``'s address, or one error line when it has none."""
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(f"--host {host}: no such address ({exc.args[-1] if exc.args else exc}); give an address "
                          f"of this machine, e.g. {DEFAULT_HOST} or 0.0.0.0 for every interface") from None


def serve(port: int, host: str = DEFAULT_HOST) -> dist.TCPStore:
    """Start the store server on ``host``'s address and ``port`` (0: a free one; see ``.port``) and return it
    (it serves while referenced)."""
    address = resolve(host)
    try:
        listen_fd = listening_socket(address, port)
        return dist.TCPStore(address, port, None, True, timeout=timedelta(seconds=30), wait_for_workers=False,
                             master_listen_fd=listen_fd)
    except (OSError, RuntimeError, dist.DistError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else first_line(exc)
        raise DistributedError(f"cannot listen on {host} port {port}: {reason}; choose another --port, or stop "
                               f"the program that listens there") from exc

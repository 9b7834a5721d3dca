"""Where the ranks meet: the key-value store of a tcp:// or file:// rendezvous, and who may use it.

The ranks then check in through it (:mod:`hetfair.launch.check_in`).

**Who may talk to the store.** torch's ``TCPStore`` has no authentication: whoever reaches
the port can read and write keys. So every tcp store's check-in is signed: rank 0's
check-in, every arrival and the abort message carry an HMAC-SHA256 over the key, the value
and a per-job nonce, and ranks act only on values whose signature verifies. The secret is
``--distributed-secret`` or :data:`SECRET_ENV`; a store on a loopback address
(``tcp://127.0.0.1:…``, torchrun with a loopback ``MASTER_ADDR``), which only this machine's
users reach, may instead use this user's own (:mod:`hetfair.launch.user_secret`). It
listens on that address only, and gloo then also on the loopback interface only. A store
on any other address listens on every interface, and its job needs the shared secret. A
local ``--distributed-world-size N`` run meets in a ``file://`` store in a directory only
its user can read, with a fresh secret. An unsigned abort message is ignored; a replayed one from
another job fails on the nonce. What the secret does not cover: the process group's
own keys (gloo's addresses), which torch reads unauthenticated after the check-in.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping, Optional
from urllib.parse import urlparse

import torch.distributed as dist

from hetfair.launch.user_secret import user_secret
from hetfair.errors import ConfigError, DistributedError, first_line

SECRET_ENV = "HETFAIR_SECRET"


@dataclass(frozen=True)
class StoreAddress:
    """Where the ranks meet: ``tcp`` (host, port) or ``file`` (path)."""

    scheme: str
    host: str = ""
    port: int = 0
    path: str = ""

    @property
    def is_loopback(self) -> bool:
        """A tcp store on a loopback address: only this machine can reach it."""
        return self.scheme == "tcp" and _is_loopback(self.host)


def parse_init_method(init_method: str, env: Mapping[str, str]) -> StoreAddress:
    """``tcp://HOST:PORT``, ``file:///path`` or ``env://`` (MASTER_ADDR/MASTER_PORT) as a :class:`StoreAddress`."""
    url = urlparse(init_method)
    if url.scheme == "env":
        host, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
        if not host or not port:
            raise DistributedError("env:// needs MASTER_ADDR and MASTER_PORT in the environment")
        url = urlparse(f"tcp://{host}:{port}")
    if url.scheme == "tcp":
        try:
            port = url.port
        except ValueError:
            port = None
        if not url.hostname or not port:
            raise DistributedError(f"--distributed-init-method {init_method}: expected tcp://HOST:PORT")
        return StoreAddress("tcp", host=url.hostname, port=port)
    if url.scheme == "file":
        return StoreAddress("file", path=url.path)
    raise DistributedError(
        f"--distributed-init-method {init_method}: unsupported scheme; use tcp://HOST:PORT, file:///path or env://"
    )


def _is_loopback(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def job_secret(given: Optional[str], address: StoreAddress, env: Mapping[str, str]) -> Optional[bytes]:
    """The secret that signs this job's check-in: ``--distributed-secret``, else :data:`SECRET_ENV`.

    A tcp store that other machines can reach needs one; on a loopback address it defaults
    to this user's loopback secret, and a file store (whose permissions say who may write
    it) runs unsigned without one.
    """
    secret = given or env.get(SECRET_ENV)
    if secret:
        return secret.encode()
    if address.is_loopback:
        return user_secret()
    if address.scheme == "tcp":
        raise ConfigError(
            f"the rendezvous at {address.host}:{address.port} can be reached from other machines: give every "
            f"node's command the same secret in the {SECRET_ENV} environment variable (or --distributed-secret), "
            f"e.g. {SECRET_ENV}=$(python -c 'import secrets; print(secrets.token_hex(16))')"
        )
    return None


def private_secret() -> str:
    """A fresh random secret for a job whose ranks all start from one command."""
    return secrets.token_hex(16)


def loopback_interface() -> str:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    return next((name for name in names if name.startswith("lo")), "lo")


def check_store_directory(address: StoreAddress) -> None:
    """Refuse a ``file://`` store whose directory does not exist (before any process starts)."""
    if address.scheme == "file" and not os.path.isdir(os.path.dirname(address.path) or "."):
        raise DistributedError(f"--distributed-init-method file://{address.path}: directory does not exist; "
                               f"create it (on a file system every node shares) or give another path")


def create_store(address: StoreAddress, rank: int, world_size: int, timeout: float) -> dist.Store:
    """Open the key-value store at ``address``: rank 0 hosts a tcp store, the others connect.

    A tcp store on a loopback address listens on that address only (torch's own would listen
    on every interface). A client first waits until rank 0's port accepts connections, so that
    a missing rank 0 is one error line after ``timeout`` seconds.
    """
    if address.scheme == "file":
        check_store_directory(address)
        store = dist.FileStore(address.path, world_size)
        store.set_timeout(timedelta(seconds=timeout))
        return store
    deadline = time.monotonic() + timeout
    try:
        if rank == 0:
            return host_tcp_store(address, world_size, timeout)
        wait_until_reachable(address, timeout, f"rank {rank} could not reach rank 0",
                             "start rank 0's command or check --distributed-init-method")
        return dist.TCPStore(address.host, address.port, world_size, is_master=False,
                             timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())))
    except (RuntimeError, OSError) as exc:
        role = "listen on" if rank == 0 else "reach rank 0 at"
        hint = "" if rank == 0 else "; check that it is rank 0's address and that no other program listens there"
        raise DistributedError(
            f"rank {rank} could not {role} {address.host}:{address.port}: {first_line(exc)}{hint}"
        ) from exc


def host_tcp_store(address: StoreAddress, world_size: int, timeout: float) -> dist.Store:
    """Host a tcp store at ``address`` (port 0: a free one, see its ``port``); on loopback, listen there only."""
    listen_fd = listening_socket(address.host, address.port, max(128, world_size)) if address.is_loopback else None
    return dist.TCPStore(address.host, address.port, world_size, is_master=True,
                         timeout=timedelta(seconds=timeout), wait_for_workers=False, master_listen_fd=listen_fd)


def listening_socket(host: str, port: int, backlog: int = 128) -> int:
    """A socket listening on ``host``'s address only (torch's store server would listen on every interface), as a
    file descriptor for ``TCPStore(master_listen_fd=...)``, which owns it from then on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(backlog)
    return listener.detach()


def wait_until_reachable(address: StoreAddress, timeout: float, failure: str, fix: str) -> None:
    """Return once ``address`` accepts connections; after ``timeout`` seconds, one error line: ``failure`` (such as
    "rank 1 could not reach rank 0"), the address, why, then ``fix``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((address.host, address.port), timeout=max(0.1, deadline - time.monotonic())):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise DistributedError(f"{failure} at {address.host}:{address.port} within {timeout:.0f}s "
                                       f"({exc.strerror or exc}); {fix}") from None
        time.sleep(0.2)

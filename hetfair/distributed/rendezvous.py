"""Meeting of all ranks through a tcp://, file:// or env:// store, with clear errors.

Before the process group is created every rank checks in through the store:
a rank whose ``--distributed-world-size`` differs from rank 0's aborts the whole
group with a message naming both values, and ranks that never arrive are
reported after ``--distributed-timeout`` instead of waiting forever.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from urllib.parse import urlparse

import torch.distributed as dist

from hetfair.errors import DistributedError, first_line

_WORLD_SIZE_KEY = "hetfair/world_size"
_ARRIVED_KEY = "hetfair/arrived"
_ABORT_KEY = "hetfair/abort"


def create_store(init_method: str, rank: int, world_size: int, timeout: float) -> dist.Store:
    """Open the key-value store named by ``init_method`` (rank 0 hosts a tcp:// store)."""
    url = urlparse(init_method)
    if url.scheme == "env":
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            raise DistributedError("env:// needs MASTER_ADDR and MASTER_PORT in the environment")
        url = urlparse(f"tcp://{host}:{port}")
    if url.scheme == "tcp":
        if not url.hostname or not url.port:
            raise DistributedError(f"--distributed-init-method {init_method}: expected tcp://HOST:PORT")
        try:
            return dist.TCPStore(
                url.hostname, url.port, world_size, is_master=rank == 0,
                timeout=timedelta(seconds=timeout), wait_for_workers=False,
            )
        except RuntimeError as exc:
            role = "listen on" if rank == 0 else "reach rank 0 at"
            raise DistributedError(
                f"rank {rank} could not {role} {url.hostname}:{url.port} within {timeout:.0f}s: {first_line(exc)}"
            ) from exc
    if url.scheme == "file":
        path = url.path
        if not os.path.isdir(os.path.dirname(path) or "."):
            raise DistributedError(f"--distributed-init-method {init_method}: directory of {path} does not exist")
        return dist.FileStore(path, world_size)
    raise DistributedError(
        f"--distributed-init-method {init_method}: unsupported scheme; use tcp://HOST:PORT, file:///path or env://"
    )


def check_in(store: dist.Store, rank: int, world_size: int, timeout: float) -> None:
    """Wait until all ``world_size`` ranks have arrived and agree on the world size."""
    if rank == 0:
        store.set(_WORLD_SIZE_KEY, str(world_size))
    else:
        try:
            expected = int(store.get(_WORLD_SIZE_KEY))
        except RuntimeError as exc:
            raise DistributedError(
                f"rank {rank}: rank 0 did not appear within {timeout:.0f}s ({first_line(exc)}); "
                f"start rank 0's command or check --distributed-init-method"
            ) from exc
        if expected != world_size:
            message = (
                f"rank {rank} was started with --distributed-world-size {world_size} but rank 0 with "
                f"{expected}; give every node's command the same --distributed-world-size"
            )
            store.set(_ABORT_KEY, message)
            raise DistributedError(message)
    store.add(_ARRIVED_KEY, 1)
    deadline = time.monotonic() + timeout
    while True:
        if store.check([_ABORT_KEY]):
            raise DistributedError(store.get(_ABORT_KEY).decode())
        arrived = store.add(_ARRIVED_KEY, 0)
        if arrived >= world_size:
            return
        if time.monotonic() > deadline:
            raise DistributedError(
                f"only {arrived} of {world_size} processes joined within {timeout:.0f}s; start every node's "
                f"command with the same --distributed-init-method, or raise --distributed-timeout"
            )
        time.sleep(0.05)


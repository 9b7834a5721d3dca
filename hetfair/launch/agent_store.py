"""A store of its own for every start of torchrun's workers.

torchrun's c10d rendezvous shares one TCPStore, the agent store at MASTER_ADDR:MASTER_PORT,
with the workers, and keeps it across every restart of them; torch's ``env://`` builds each
new process group in it under the same key names as the last one (pytorch/pytorch#135712).
A restarted worker may then read the address of a peer that is gone ("Gloo connectFullMesh
failed ... Connection refused") or wait for keys an earlier start already used until the
timeout. So hetfair uses the agent store only to find a store of this start's own: rank 0
hosts a new store on a free port and publishes ``port|nonce`` in the agent store; the
others read it, connect, and take the store only if it holds the same nonce: a value left
by an earlier start names a store that is gone (or one that holds another nonce), and is
read again until rank 0's new one replaces it. With the job's secret the published value
is signed (see :mod:`hetfair.launch.check_in`): one that another client wrote into
torchrun's store is ignored.
"""

from __future__ import annotations

import secrets
import socket
import time
from datetime import timedelta
from typing import Mapping, Optional

import torch.distributed as dist

from hetfair.launch.check_in import Signer
from hetfair.launch.rendezvous import StoreAddress, host_tcp_store
from hetfair.errors import DistributedError, first_line

USE_AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
_ADDRESS_KEY = "hetfair/worker_store"
_NONCE_KEY = "hetfair/nonce"
_POLL_SECONDS = 0.1


def uses_agent_store(env: Mapping[str, str]) -> bool:
    """Whether torchrun shares its rendezvous store with the workers (torch's default with c10d)."""
    return env.get(USE_AGENT_STORE_ENV) == "True"


def join_warning(env: Mapping[str, str]) -> str | None:
    """What to tell a torchrun job that may restart while torchrun shares its store (``None``: nothing).

    With the shared store, a node that joins a running job waits for start-up keys the leading
    agent wrote only once (torch 2.13), so it cannot take part; a new store every start avoids it.
    """
    if not uses_agent_store(env) or env.get("TORCHELASTIC_MAX_RESTARTS", "0") == "0":
        return None
    return ("torchrun shares its rendezvous store with the workers, so a node that joins this job later cannot "
            "take part; set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for every torchrun of an elastic job")


def fresh_store(env: Mapping[str, str], rank: int, world_size: int, timeout: float,
                secret: Optional[bytes]) -> dist.Store:
    """This start's own store, found through the agent store, within ``timeout`` seconds; ``secret`` signs where."""
    signer = Signer(secret)
    host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    deadline = time.monotonic() + timeout
    try:
        agent = dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout))
    except (RuntimeError, OSError) as exc:
        raise DistributedError(f"rank {rank} could not reach torchrun's store at {host}:{port}: "
                               f"{first_line(exc)}") from exc
    if rank == 0:
        store = host_tcp_store(StoreAddress("tcp", host=host, port=0), world_size, timeout)
        nonce = secrets.token_hex(8)
        store.set(_NONCE_KEY, nonce)
        agent.set(_ADDRESS_KEY, signer.sign(_ADDRESS_KEY, f"{store.port}|{nonce}"))
        return store
    while time.monotonic() < deadline:
        if agent.check([_ADDRESS_KEY]):
            published = signer.verify(_ADDRESS_KEY, agent.get(_ADDRESS_KEY))
            store = None if published is None else _open_if_current(host, published, world_size, deadline)
            if store is not None:
                return store
        time.sleep(_POLL_SECONDS)
    raise DistributedError(f"rank {rank}: rank 0 published no store of this start within {timeout:.0f}s; "
                           f"see rank 0's node for its error, or raise --distributed-timeout")


def _open_if_current(host: str, published: str, world_size: int, deadline: float) -> dist.Store | None:
    """The store ``published`` names, if it is alive and holds the nonce published with it."""
    port, _, nonce = published.partition("|")
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            pass
        store = dist.TCPStore(host, int(port), world_size, is_master=False,
                              timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())))
        if store.check([_NONCE_KEY]) and store.get(_NONCE_KEY).decode() == nonce:
            return store
    except (RuntimeError, OSError, ValueError):
        pass  # gone: an earlier start's
    return None

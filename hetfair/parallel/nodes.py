"""Which ranks share a node, for hybrid sharding: one exchange of each rank's machine identity.

A node is one network stack on one machine: the ranks whose traffic between each other
crosses no network link. Each rank names its own (the kernel's boot id, random for every
boot of every machine, and the inode of its network namespace, so containers and network
namespaces of one machine are nodes of their own; the host name where ``/proc`` has
neither), the ranks gather the names in one exchange, and each derives the same layout
from the same list. This needs nothing from the launcher: a node's ranks may come from one
command (``--distributed-gpus``), from torchrun, SLURM or one command each.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from hetfair.errors import ConfigError
from hetfair.parallel.collectives import all_gather_json
from hetfair.parallel.context import DistributedContext

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_NETWORK_NAMESPACE = "/proc/self/ns/net"


def node_identity() -> str:
    """This process's machine and network namespace, as a name equal on exactly the ranks of its node."""
    try:
        return f"{_BOOT_ID.read_text().strip()}/{os.readlink(_NETWORK_NAMESPACE)}"
    except OSError:  # no /proc (not Linux)
        return socket.gethostname()


def gather_layout(context: DistributedContext) -> list[list[int]]:
    """The ranks of each node of the job (one collective: every rank's :func:`node_identity`)."""
    return node_layout(all_gather_json(context, node_identity()))


def node_layout(identities: list[str]) -> list[list[int]]:
    """The ranks of each node, given every rank's node name (indexed by rank): each node's ranks
    ascending, the nodes in the order of their lowest rank. Every node must hold as many ranks as
    the others (a 2-D mesh is a rectangle); otherwise one :class:`ConfigError`."""
    nodes: dict[str, list[int]] = {}
    for rank, identity in enumerate(identities):
        nodes.setdefault(identity, []).append(rank)
    layout = list(nodes.values())
    if len({len(ranks) for ranks in layout}) > 1:
        described = "; ".join(f"ranks {', '.join(map(str, ranks))} on one node" for ranks in layout)
        raise ConfigError(f"--ddp-backend hybrid_sharded needs the same number of processes on every node, "
                          f"but the job has {described}; start as many on each node, or give --shard-group-size N "
                          f"(consecutive ranks shard together) or use --ddp-backend fully_sharded")
    return layout


def rank_blocks(world_size: int, size: int) -> list[list[int]]:
    """Consecutive ranks in groups of ``size`` (``--shard-group-size``; ``size`` divides ``world_size``)."""
    return [list(range(start, start + size)) for start in range(0, world_size, size)]


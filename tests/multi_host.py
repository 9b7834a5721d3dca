"""Starting hetfair-train on the hosts of a test network (tests/netns.py) and collecting what each command said."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path
from typing import Sequence

from helpers import rank_flags, subprocess_env, train_command
from hetfair.launch.native_output import CPP_LOG_LEVEL_ENV
from hetfair.launch.network import GLOO_INTERFACE_ENV, NCCL_INTERFACE_ENV
from hetfair.launch.rendezvous import SECRET_ENV
from toy_reference import toy_train_args

HOSTNAME_MEANS_LOOPBACK = {"hosts": f"127.0.0.1 localhost\n127.0.0.1 {socket.gethostname()}\n", "resolv.conf": ""}
"""``/etc`` files of a host that maps the machine's hostname to 127.0.0.1 (as many do) and has no name server."""


def node_env() -> dict[str, str]:
    """The environment of one node's command: the job's secret, no interface chosen for gloo or NCCL."""
    env = {name: value for name, value in subprocess_env().items()
           if name not in (GLOO_INTERFACE_ENV, NCCL_INTERFACE_ENV, CPP_LOG_LEVEL_ENV)}
    return {**env, SECRET_ENV: "the job's secret"}


def start_nodes(network, tmp_path: Path, *extra: str, env: dict[str, str] | None = None,
                own: Sequence[tuple[Sequence[str], dict[str, str]]] = ()) -> list[subprocess.Popen]:
    """One hetfair-train command per host (a toy job of two ranks meeting at host 0), each with its batch size,
    in ``env`` (default: :func:`node_env`); ``own``: each node's own further flags and environment variables."""
    init = f"tcp://{network.hosts[0].address}:29500"
    procs = []
    for rank, (host, batch) in enumerate(zip(network.hosts, ("12", "20"))):
        flags, variables = own[rank] if rank < len(own) else ((), {})
        args = toy_train_args(tmp_path / "ckpt", 1) + ["--max-sentences", batch, *rank_flags(rank, 2, init), *extra,
                                                       *flags]
        procs.append(subprocess.Popen(host.command(*train_command(*args)), cwd=tmp_path,
                                      env={**(env or node_env()), **variables},
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def finish(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    """Each command's exit code and stderr."""
    try:
        errors = [proc.communicate(timeout=240)[1] for proc in procs]
        return [(proc.returncode, err) for proc, err in zip(procs, errors)]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()

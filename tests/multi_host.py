"""Starting hetfair-train on the hosts of a test network (tests/netns.py) and collecting what each command said."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Mapping, Sequence

from forked_cli import ForkedCommand, start_forked
from helpers import rank_flags, subprocess_env
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


def start_on(network, index: int, args: Sequence[str], cwd: Path, env: Mapping[str, str]) -> ForkedCommand:
    """``hetfair-train args`` on host ``index`` of ``network``, forked into the host's namespace (``forked_cli``)."""
    return start_forked(args, cwd, env, network.hosts[index].namespace)


def start_nodes(network, tmp_path: Path, *extra: str, env: dict[str, str] | None = None,
                own: Sequence[tuple[Sequence[str], dict[str, str]]] = ()) -> list[ForkedCommand]:
    """One hetfair-train command per host (a toy job of two ranks meeting at host 0), each with its batch size,
    in ``env`` (default: :func:`node_env`); ``own``: each node's own further flags and environment variables."""
    init = f"tcp://{network.hosts[0].address}:29500"
    procs = []
    for rank, batch in enumerate(("12", "20")):
        flags, variables = own[rank] if rank < len(own) else ((), {})
        args = toy_train_args(tmp_path / "ckpt", 1) + ["--max-sentences", batch, *rank_flags(rank, 2, init), *extra,
                                                       *flags]
        procs.append(start_on(network, rank, args, tmp_path, {**(env or node_env()), **variables}))
    return procs


def finish(procs: Sequence[ForkedCommand]) -> list[tuple[int, str]]:
    """Each command's exit code and stderr."""
    try:
        errors = [proc.communicate(timeout=240)[1] for proc in procs]
        return [(proc.returncode, err) for proc, err in zip(procs, errors)]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()

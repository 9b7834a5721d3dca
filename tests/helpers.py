"""Shared helpers for tests that run hetfair-train as real processes."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Sequence

import pytest
import torch
import torch.distributed as dist

from forked_cli import run_forked

_SHARED = str(Path(__file__).resolve().parents[1] / "benchmarks")  # common.py: the process tree helpers
if _SHARED not in sys.path:
    sys.path.append(_SHARED)

from common import descendants, rank_pids as worker_pids  # noqa: E402,F401  (for the tests)

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
TOY_PLUGIN = TESTS_DIR / "toy_plugin"
FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
"""Debian's dataset-fashion-mnist: the real images, for the tests that read them."""


def fashion_mnist_installed() -> bool:
    return (FASHION_MNIST / "train-images-idx3-ubyte.gz").is_file()


needs_fashion_mnist = pytest.mark.skipif(
    not fashion_mnist_installed(),
    reason=f"Fashion-MNIST is not installed in {FASHION_MNIST} (Debian package dataset-fashion-mnist)",
)


def leave_group() -> None:
    """Destroy the default process group, once the caller holds no model wrapped in DDP.

    A DDP reducer freed after ``destroy_process_group`` is the group's last owner: the group's C++
    destructor then joins gloo's threads holding the GIL, and a gloo thread freeing a finished work
    started in a backward needs the GIL (torch keeps a Python object in the work's thread state), so
    the rank hangs now and then. Collecting first frees unreachable reducers while the group is registered.
    """
    gc.collect()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "hetfair_cli.train", *args]


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def start(args: Sequence[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(train_command(*args), cwd=cwd, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_nodes(commands: list[list[str]], cwd: Path, timeout: float = 180) -> list[subprocess.CompletedProcess]:
    """Start several hetfair-train commands at once (as separate 'nodes') and wait for all.

    Each command is a process forked from a pre-imported interpreter (``forked_cli``): the same
    ``main(argv)`` in a process of its own, without a torch import per command.
    """
    return run_forked(commands, cwd, subprocess_env(), timeout)


def run_train(args: Sequence[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    """One hetfair-train command, run as :func:`run_nodes` runs each of its commands."""
    [result] = run_nodes([list(args)], cwd, timeout)
    return result


def final_parameters(save_dir: Path) -> dict[str, torch.Tensor]:
    state = torch.load(save_dir / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    return state["trainer"]["model"]


def child_pids(pid: int) -> list[int]:
    """PIDs of the processes ``pid`` started and that are still its children (e.g. a rank's DataLoader workers)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(child) for child in (task / "children").read_text().split()]
    return sorted(children)


def is_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def node_commands(common: Sequence[str], batch_sizes: Sequence[int], init_method: str,
                  *per_node: str) -> list[list[str]]:
    """One hetfair-train command per rank, each with its own --max-sentences; ranks meet at ``init_method``.

    A single batch size gives one plain single-process command. ``per_node`` flags go to every
    command of a multi-process job (e.g. ``--ddp-backend fully_sharded``).
    """
    world = len(batch_sizes)
    commands = []
    for rank, batch in enumerate(batch_sizes):
        node = ["--max-sentences", str(batch)]
        if world > 1:
            node += [*rank_flags(rank, world, init_method), *per_node]
        commands.append([*common, *node])
    return commands


def rank_flags(rank: int, world_size: int, init_method: str) -> list[str]:
    """The flags that make one hetfair-train command rank ``rank`` of ``world_size``, one process each."""
    return ["--distributed-world-size", str(world_size), "--distributed-rank", str(rank),
            "--distributed-gpus", "1", "--distributed-init-method", init_method]


class LoopbackListener:
    """A TCP server on 127.0.0.1 that accepts connections and never answers: it keeps each one open, or
    closes it at once (``close_each``); ``accepted`` counts them."""

    def __init__(self, close_each: bool = False) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/"
        self.close_each = close_each
        self.accepted = 0
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.server.accept()
            except OSError:
                return
            self.accepted += 1
            if self.close_each:
                connection.close()
            else:
                self._open.append(connection)

    def close(self) -> None:
        self.server.close()
        for connection in self._open:
            connection.close()


def damaged(compressed: bytes, how: str) -> bytes:
    """``compressed`` (gzip, bz2 or xz data) cut in half (``"truncated"``) or with garbage written over its middle
    (``"corrupt"``), as an interrupted download or a bad disk leaves a file."""
    middle = len(compressed) // 2
    if how == "truncated":
        return compressed[:middle]
    return compressed[:middle] + b"\x00garbage" * 8 + compressed[middle + 64:]

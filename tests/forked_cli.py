"""hetfair-train commands as processes forked from one interpreter that has imported torch and hetfair already.

A fresh ``python -m hetfair_cli.train`` spends about 2.6 s of CPU importing torch before it parses its
first flag (and 5 s more where it fine-tunes a transformers model); the suite starts over a thousand of
them. multiprocessing's forkserver pays that import once: its server process preloads the modules and
forks a child per command. Each child is still a process of
its own (its own gloo rank, signals, exit status and files), starts from the server's clean state rather
than from an earlier test's, and runs ``main(argv)`` as ``python -m hetfair_cli.train`` does.

Tests that need the real executable (the commands the docs show, kills of a launcher's ranks by their
command line) start it with :func:`helpers.start`.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
from multiprocessing import forkserver, resource_tracker
from pathlib import Path
from typing import Mapping, Sequence

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload([
    "torch", "hetfair_cli.train", "forked_cli",
    # The Hugging Face families' children would each spend ~5 s more importing these.
    "transformers.modeling_utils", "transformers.models.auto.modeling_auto", "datasets",
])


def _run_main(args: list[str], cwd: str, env: dict[str, str], out_path: str, err_path: str) -> None:
    """The child: the command's directory, environment and output files, then ``hetfair-train``'s main."""
    import torch

    from hetfair_cli.train import main

    resource_tracker._resource_tracker._fd = None  # its own tracker, started when needed, as a fresh process has:
    resource_tracker._resource_tracker._pid = None  # what it leaks is reported on its own stderr
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))  # read once by torch, before this fork
    sys.argv = ["hetfair-train", *args]
    added = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry and entry not in sys.path]
    sys.path[:0] = added  # an interpreter started with this environment would search them first
    for fd, path in ((1, out_path), (2, err_path)):
        with open(path, "wb") as file:
            os.dup2(file.fileno(), fd)
    sys.exit(main(args))


def start_server() -> None:
    """Start the fork server now, from this process's environment as it is (before a test changes it)."""
    forkserver.ensure_running()


def run_forked(commands: Sequence[Sequence[str]], cwd: Path, env: Mapping[str, str],
               timeout: float) -> list[subprocess.CompletedProcess]:
    """Run ``hetfair-train`` commands at once, each its own process, and wait for all (killing all at ``timeout``)."""
    with tempfile.TemporaryDirectory(prefix="forked-cli-") as outputs:
        processes = []
        for index, args in enumerate(commands):
            out_path, err_path = (os.path.join(outputs, f"{index}.{stream}") for stream in ("out", "err"))
            process = _CONTEXT.Process(target=_run_main, args=(list(args), str(cwd), dict(env), out_path, err_path))
            process.start()
            processes.append((args, process, out_path, err_path))
        results = []
        for args, process, out_path, err_path in processes:
            process.join(timeout)
            if process.exitcode is None:
                for _, other, _, _ in processes:
                    other.kill()
                    other.join()
                raise subprocess.TimeoutExpired(list(args), timeout)
            results.append(subprocess.CompletedProcess(list(args), process.exitcode, _read(out_path), _read(err_path)))
        return results


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:  # the child died before it opened its files
        return ""

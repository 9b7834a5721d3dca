"""hetfair-train commands as processes forked from one interpreter that has imported torch and hetfair already.

A fresh ``python -m hetfair_cli.train`` spends about 2.6 s of CPU importing torch before it parses its
first flag (and 5 s more where it fine-tunes a transformers model); the suite starts over a thousand of
them. multiprocessing's forkserver pays that import once: its server process preloads the modules and
forks a child per command. Each child is still a process of
its own (its own gloo rank, signals, exit status and files), starts from the server's clean state rather
than from an earlier test's, and runs ``main(argv)`` as ``python -m hetfair_cli.train`` does.

The launcher's ranks come from the same server: hetfair's launcher forks its workers from a
multiprocessing fork server, and a forked command is pointed at this one (already preloaded) instead
of starting its own. The server starts the first time anything forks from it (:func:`serve_on_demand`),
as the launcher starts its own (SIGINT ignored, the worker signals blocked:
:func:`hetfair.launch.supervisor.worker_start_state`), and each worker is given what a worker of the command's own server would have: the command's environment and output
(:class:`_CommandState`, sent with multiprocessing's preparation data).

A command may run on a host of a test network (``tests/netns.py``): before anything else its process joins
the host's network namespace and binds the host's own ``/etc`` files in a mount namespace of its own, as
``ip netns exec`` would have, and so does each of its workers (the namespace travels with their preparation
data).

Tests that need the real executable (the commands the docs show, kills of a launcher's ranks by their
command line, an environment variable that torch reads as it is imported, such as ``TORCH_LOGS``) start it
with :func:`helpers.start` or ``Host.command``.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
from multiprocessing import context, forkserver, popen_forkserver, reduction, resource_tracker, spawn
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from hetfair.launch.supervisor import worker_start_state
from netns import NETNS_ETC

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload([
    "torch", "hetfair_cli.train", "forked_cli",
    # The Hugging Face families' children would each spend ~5 s more importing these.
    "transformers.modeling_utils", "transformers.models.auto.modeling_auto", "datasets",
])


_CLONE_NEWNET, _CLONE_NEWNS = 0x40000000, 0x00020000
_MS_BIND, _MS_REC, _MS_SLAVE = 0x1000, 0x4000, 0x80000
_NETNS_DIR = Path("/run/netns")
"""Where ``ip netns add`` keeps a handle on each named network namespace."""
_namespace: Optional[str] = None
"""The network namespace this forked command runs in, which its workers join too (``None``: the server's)."""


def _join_namespace(namespace: Optional[str]) -> None:
    """Move this process (a freshly forked child: one thread, no sockets yet) into the named network namespace,
    with the files of ``/etc/netns/NAMESPACE`` over those of ``/etc``, as ``ip netns exec`` does."""
    global _namespace
    if namespace is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    with open(_NETNS_DIR / namespace, "rb") as handle:
        _check(libc.setns(handle.fileno(), _CLONE_NEWNET), f"join network namespace {namespace}")
    etc = NETNS_ETC / namespace
    if etc.is_dir():
        _check(libc.unshare(_CLONE_NEWNS), "make a mount namespace")
        _check(libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None), "keep its mounts from the machine's")
        for file in sorted(etc.iterdir()):
            target = Path("/etc") / file.name
            _check(libc.mount(os.fsencode(file), os.fsencode(target), b"none", _MS_BIND, None), f"bind {target}")
    _namespace = namespace


def _check(result: int, action: str) -> None:
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"cannot {action}: {os.strerror(error)}")


def become_command(namespace: Optional[str], server: str) -> None:
    """Make this child of the server what a fresh command's process would be: on its host (``namespace``), with
    its own resource tracker and a fresh interpreter's signal state; its workers are forked from ``server`` too."""
    _join_namespace(namespace)
    resource_tracker._resource_tracker._fd = None  # its own tracker, started when needed, as a fresh process has:
    resource_tracker._resource_tracker._pid = None  # what it leaks is reported on its own stderr
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    forkserver._forkserver._forkserver_address = server
    forkserver._forkserver.ensure_running = resource_tracker.ensure_running


def _run_main(args: list[str], cwd: str, env: dict[str, str], out_path: str, err_path: str, server: str,
              namespace: Optional[str]) -> None:
    """The child: the command's network namespace, directory, environment and output files, then
    ``hetfair-train``'s main."""
    from hetfair_cli.train import main

    become_command(namespace, server)
    os.chdir(cwd)
    _adopt_environment(env)
    sys.argv = ["hetfair-train", *args]
    added = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry and entry not in sys.path]
    sys.path[:0] = added  # an interpreter started with this environment would search them first
    for fd, path in ((1, out_path), (2, err_path)):
        with open(path, "wb") as file:
            os.dup2(file.fileno(), fd)
    sys.exit(main(args))


class _CommandState:
    """Sent with a worker's preparation data: the environment and output of the process that starts it, which a
    worker of that process's own fork server would inherit (this server's are the pytest process's)."""

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        if not isinstance(context.get_spawning_popen(), popen_forkserver.Popen):
            return dict, ()  # another start method: nothing to carry
        return _take_command_state, (dict(os.environ), reduction.DupFd(1), reduction.DupFd(2), _namespace)


def _take_command_state(env: dict[str, str], stdout: Any, stderr: Any, namespace: Optional[str]) -> dict:
    """In the worker, as its preparation data is read: the starting process's network namespace, environment
    and output."""
    _join_namespace(namespace)
    _adopt_environment(env)
    for fd, inherited in ((1, stdout), (2, stderr)):
        received = inherited.detach()
        os.dup2(received, fd)
        os.close(received)
    return {}


def _adopt_environment(env: Mapping[str, str]) -> None:
    """This process's environment becomes ``env``, with torch's thread count (which torch read once, in the
    server) as ``OMP_NUM_THREADS`` says."""
    import torch

    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))


def _preparation_data(name: str) -> dict[str, Any]:
    return {**_plain_preparation_data(name), "forked_cli_state": _CommandState()}


_plain_preparation_data = spawn.get_preparation_data
spawn.get_preparation_data = _preparation_data


_READ_AT_IMPORT = ("TORCH_LOGS", "TORCH_CPP_LOG_LEVEL")
"""Environment variables torch reads once, as it is imported: the server's values hold in every forked command."""
_SERVER_ENV: dict[str, str] = {}


_TESTS_PRELOAD = list(forkserver._forkserver._preload_modules)
_start_plainly = forkserver._forkserver.ensure_running


def serve_on_demand() -> None:
    """Start the fork server the first time anything forks from it (a forked command, or a test's
    ``run_workers``), from this process's environment as it is now (before a test changes it), with the
    tests' preload, in the signal state hetfair's launcher starts its own in.

    A pytest process (or xdist worker) whose tests fork nothing never pays the server's imports (torch,
    transformers, datasets: about 7 s of CPU).
    """
    _SERVER_ENV.update(os.environ)
    forkserver._forkserver.ensure_running = _ensure_running


def _ensure_running() -> None:
    if forkserver._forkserver._forkserver_pid is not None:
        return _start_plainly()  # running (or restarted where it died)
    here = str(Path(__file__).resolve().parent)
    current = dict(os.environ)
    os.environ.clear()
    os.environ.update(_SERVER_ENV)
    # the server imports this module (its preload; a worker reads _CommandState before anything else), and
    # Python 3.11's forkserver ignores the sys.path it is handed: it searches PYTHONPATH
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, _SERVER_ENV.get("PYTHONPATH")]))
    forkserver._forkserver._preload_modules = _TESTS_PRELOAD  # not the preload of a test's run_workers
    try:
        with worker_start_state():
            _start_plainly()
    finally:
        os.environ.clear()
        os.environ.update(current)


class ForkedCommand:
    """A ``hetfair-train`` command started by :func:`start_forked`: what the tests use of a ``subprocess.Popen``
    with text pipes (``pid``, ``returncode``, ``poll``, ``wait``, ``communicate``, ``kill``)."""

    def __init__(self, args: Sequence[str], cwd: Path, env: Mapping[str, str], namespace: Optional[str]) -> None:
        self.args = list(args)
        self._outputs = tempfile.TemporaryDirectory(prefix="forked-cli-")
        self._out_path, self._err_path = (os.path.join(self._outputs.name, name) for name in ("out", "err"))
        self._process = _CONTEXT.Process(target=_run_main, args=(
            self.args, str(cwd), dict(env), self._out_path, self._err_path,
            forkserver._forkserver._forkserver_address, namespace))
        self._process.start()

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> Optional[int]:
        return self._process.exitcode

    def poll(self) -> Optional[int]:
        return self._process.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def communicate(self, timeout: Optional[float] = None) -> tuple[str, str]:
        """Wait for the command to end; what it wrote to stdout and stderr."""
        self.wait(timeout)
        return _read(self._out_path), _read(self._err_path)

    def kill(self) -> None:
        self._process.kill()


def start_forked(args: Sequence[str], cwd: Path, env: Mapping[str, str],
                 namespace: Optional[str] = None) -> ForkedCommand:
    """Start one ``hetfair-train`` command, in network namespace ``namespace`` if given."""
    read_at_import = [name for name in _READ_AT_IMPORT if env.get(name) != _SERVER_ENV.get(name)]
    if read_at_import:
        raise ValueError(f"{', '.join(read_at_import)} is read as torch is imported, in the fork server: "
                         f"start this command with helpers.start instead")
    forkserver._forkserver.ensure_running()  # its address goes to each command's launcher
    return ForkedCommand(args, cwd, env, namespace)


def run_forked(commands: Sequence[Sequence[str]], cwd: Path, env: Mapping[str, str],
               timeout: float) -> list[subprocess.CompletedProcess]:
    """Run ``hetfair-train`` commands at once, each its own process, and wait for all (killing all at ``timeout``)."""
    started = [start_forked(args, cwd, env) for args in commands]
    results = []
    for command in started:
        try:
            out, err = command.communicate(timeout)
        except subprocess.TimeoutExpired:
            for other in started:
                other.kill()
                other.wait()
            raise
        results.append(subprocess.CompletedProcess(command.args, command.returncode, out, err))
    return results


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:  # the child died before it opened its files
        return ""

"""The local worker processes of one command: started, watched and stopped together.

* Every worker reports why it ends through its own pipe; the launcher turns the first
  failure into one error line (the root cause: the rank that failed first) and stops
  the others.
* SIGINT to the launcher stops every worker now: :data:`STOP_SIGNAL` first (a worker turns
  it into KeyboardInterrupt, so a checkpoint being written is cleaned up), SIGKILL after
  :data:`STOP_GRACE_SECONDS`. Workers start with SIGINT ignored, so Ctrl-C in a terminal
  reaches the launcher alone and prints one line, not one traceback per process.
* SIGTERM or SIGUSR1 to the launcher (a scheduler's preemption) is forwarded to every worker
  as SIGUSR1 (see :mod:`hetfair.launch.preemption`): they agree on an update, save and
  exit with the preemption code, which the launcher passes on; it waits for them at most
  :data:`PREEMPT_GRACE_SECONDS`. A second SIGTERM, or SIGINT, stops them now. Workers start
  with these signals blocked and unblock them once their handlers are in place.
* Workers are forked from a fork server that imported torch and the trainer once (multiprocessing's
  ``forkserver``): N ranks cost one torch import, not N, and share its memory; each still starts
  clean (the server never trains) with the launcher's environment and output.
* A worker whose launcher dies (even by SIGKILL) gets :data:`STOP_SIGNAL` at once (it waits on
  the launcher's pidfd, Linux; elsewhere it notices within a second); so does a launcher started
  by torchrun whose agent dies (the kernel's parent-death signal).
* A worker leaves with ``os._exit``: torch's gloo and store threads outlive
  ``destroy_process_group`` (the process group stays referenced once DDP used it), and
  running the interpreter's finalization and C++ static destructors while they are alive
  is what ended ranks with SIGABRT ("terminate called without an active exception").
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import select
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import forkserver
from multiprocessing.connection import Connection, wait
from types import FrameType
from typing import Any, Callable, Iterator, NoReturn, Optional, Sequence

from hetfair.launch.preemption import PREEMPT_SIGNALS, PREEMPTED_EXIT_CODE, preemptible
from hetfair.errors import DistributedError, HetfairError, Interrupted, JobWideError, Preempted, first_line

STOP_GRACE_SECONDS = 2.0
STOP_SIGNAL = signal.SIGUSR2
"""What the launcher sends a worker to stop it now (SIGTERM asks it to save and stop: preemption)."""
_FINALIZER_RETRY_SECONDS = 0.01
"""How long a stop that arrived inside a ``__del__`` waits before it is raised again."""
PREEMPT_GRACE_SECONDS = 300.0
"""How long the launcher waits for preempted workers to finish their update and save before stopping them."""
_WORKER_SIGNALS = {*PREEMPT_SIGNALS, STOP_SIGNAL}
_CLEAN_EXITS = (0, PREEMPTED_EXIT_CODE)  # a preempted worker saved and stopped as asked
_POLL_SECONDS = 0.25
_CHILD_REAP_SECONDS = 1.0
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
RANK_PROCESS_PREFIX = "hetfair-rank"
"""A worker's process name (``ps -o comm``, ``top``) is this and its rank: all share the fork server's command line."""


@dataclass(frozen=True)
class WorkerReport:
    """Why a worker ended, sent to the launcher just before it exits."""

    rank: int
    message: str
    exit_code: int
    job_wide: bool = False
    """The message is the job's (a :class:`~hetfair.errors.JobWideError`), not about this rank."""


# -- inside a worker ---------------------------------------------------------------

_report_channel: Optional[tuple[int, Connection]] = None  # this worker's rank and pipe (set once per process)
_launcher_gone = threading.Event()  # set in a worker when the process it watches (its launcher) has died


def give_up(message: str, exit_code: int = 2) -> NoReturn:
    """End this worker now with one reported line, even from another thread (e.g. a watchdog).

    For waits that cannot be interrupted from Python (a store connection that never answers).
    """
    if _report_channel is not None:
        rank, channel = _report_channel
        _send(channel, WorkerReport(rank, message, exit_code))
    else:
        print(f"hetfair-train: error: {message}", file=sys.stderr)
    _flush()
    os._exit(exit_code)


@contextmanager
def deadline(seconds: float, message: str | Callable[[], str]) -> Iterator[None]:
    """Run the block; if it is not done after ``seconds``, :func:`give_up` with ``message`` (or what it returns
    then, for a message that tells what the block had seen)."""
    timer = threading.Timer(seconds, lambda: give_up(message if isinstance(message, str) else message()))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()


def _worker_main(index: int, rank: int, channel: Connection, launcher_pid: int,
                 target: Callable[..., None], target_args: tuple[Any, ...]) -> None:
    global _report_channel
    _report_channel = (rank, channel)
    signal.signal(STOP_SIGNAL, _stop_now)
    _name_process(f"{RANK_PROCESS_PREFIX}{rank}")
    _leave_fork_server()
    _stop_when_gone(launcher_pid)
    report = WorkerReport(rank, "", 0)
    try:
        with preemptible():
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _WORKER_SIGNALS)  # blocked by the launcher until now
            target(index, *target_args)
    except Preempted as exc:
        report = WorkerReport(rank, exc.detail, exc.exit_code)  # the launcher names the signal
    except HetfairError as exc:
        report = WorkerReport(rank, str(exc).replace("\n", " "), exc.exit_code, isinstance(exc, JobWideError))
    except KeyboardInterrupt:
        report = WorkerReport(rank, "interrupted", 130)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        report = WorkerReport(rank, f"exited with code {code}", code)
    except BaseException as exc:  # noqa: BLE001 - a bug: keep its traceback, report one line
        traceback.print_exc()
        report = WorkerReport(rank, f"{type(exc).__name__}: {first_line(exc)} (traceback above)", 1)
    for signum in _WORKER_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)  # nothing may interrupt the report
    _end_children()
    _send(channel, report)
    _flush()
    os._exit(report.exit_code)


def _end_children() -> None:
    """Kill this worker's own processes (DataLoader workers) and reap them.

    ``os._exit`` skips multiprocessing's exit handler, which would stop them; left alone they
    notice the rank is gone only seconds later, holding the command's output open meanwhile.
    torch's SIGCHLD handler, which turns a DataLoader worker's death into an error, goes first.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    children = mp.active_children()
    for child in children:
        child.kill()
    for child in children:
        child.join(_CHILD_REAP_SECONDS)


def _stop_now(signum: int, frame: Optional[FrameType]) -> None:
    if _in_finalizer(frame):  # the interpreter would drop what this raises: stop a moment later instead
        retry = threading.Timer(_FINALIZER_RETRY_SECONDS, _signal, (os.getpid(), signum))
        retry.daemon = True
        retry.start()
        return
    for ignored in _WORKER_SIGNALS:
        signal.signal(ignored, signal.SIG_IGN)  # a second signal must not interrupt the clean-up
    _end_children()  # first: a DataLoader worker whose hand-over the interrupt cuts short would print a traceback
    raise KeyboardInterrupt


def _in_finalizer(frame: Optional[FrameType]) -> bool:
    """Whether ``frame`` runs inside a ``__del__``: an exception raised there is printed as "Exception
    ignored in ..." and dropped, so a stop raised there would be lost (and its traceback shown)."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def exit_with_parent() -> None:
    """Get :data:`STOP_SIGNAL` when the parent process dies, even by SIGKILL (e.g. torchrun's agent, whose
    workers would otherwise live on)."""
    parent = os.getppid()
    if not _on_parent_death(STOP_SIGNAL):  # not Linux: watch the parent instead
        _stop_when_gone(parent)
    elif os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def launcher_is_gone() -> bool:
    """In a worker: whether its launcher has died (killed: it could not clean up after the job)."""
    return _launcher_gone.is_set()


def _leave_fork_server() -> None:
    """Close this worker's copy of the launcher's end of the fork server's "alive" pipe, which every child of
    the server is given: the server then ends with the launcher instead of outliving it with the workers."""
    server = forkserver._forkserver  # noqa: SLF001 - multiprocessing keeps the fd on this instance only
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        os.close(alive)
        server._forkserver_alive_fd = None


def _stop_when_gone(pid: int) -> None:
    """Send this process :data:`STOP_SIGNAL` when process ``pid`` ends (it has ended already: exit now)."""
    try:
        handle: Optional[int] = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):  # not Linux, or a kernel before 5.3: look once a second
        handle = None
    threading.Thread(target=_watch_process, args=(pid, handle), daemon=True).start()


def die_with_rank(worker_id: int) -> None:
    """A DataLoader ``worker_init_fn``: the worker is killed the moment its rank ends, even by SIGKILL (Linux).

    Without it a worker of a killed rank lives on until torch's watchdog notices (seconds,
    more under load), holding the command's output open.
    """
    _on_parent_death(signal.SIGKILL)


def _on_parent_death(signum: int) -> bool:
    """Have the kernel send ``signum`` to this process when its parent dies; False where prctl is missing."""
    return _prctl(_PR_SET_PDEATHSIG, signum)


def _name_process(name: str) -> None:
    _prctl(_PR_SET_NAME, ctypes.create_string_buffer(name.encode()[:15]))  # the kernel keeps 15 bytes


def _prctl(option: int, value: Any) -> bool:
    """Linux's prctl(2); False where it is missing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(option, value)
    except (OSError, AttributeError):
        return False
    return True


def _watch_process(pid: int, handle: Optional[int]) -> None:
    if handle is not None:
        select.select([handle], [], [])  # readable once the process has ended
    else:
        while _is_running(pid):
            time.sleep(1.0)
    _launcher_gone.set()
    os.kill(os.getpid(), STOP_SIGNAL)


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or the number is another user's process now
        return False
    return True


def _send(channel: Connection, report: WorkerReport) -> None:
    try:
        channel.send(report)
    except OSError:
        pass  # the launcher is gone


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


# -- in the launcher -----------------------------------------------------------------


def run_workers(count: int, first_rank: int, target: Callable[..., None], target_args: tuple[Any, ...]) -> None:
    """Run ``target(index, *target_args)`` in ``count`` worker processes and wait for all of them.

    A worker that fails stops the others and raises its error here as one line; SIGINT stops
    them all and raises :class:`Interrupted`; SIGTERM or SIGUSR1 preempts them (they save and
    stop) and raises :class:`Preempted`.
    """
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_preload(target, target_args))  # read when the server starts
    pipes = [context.Pipe(duplex=False) for _ in range(count)]
    processes = [
        context.Process(target=_worker_main, name=f"{RANK_PROCESS_PREFIX}{first_rank + i}",
                        args=(i, first_rank + i, pipes[i][1], os.getpid(), target, target_args))
        for i in range(count)
    ]
    watch = _Watch(processes, [reader for reader, _ in pipes], first_rank)
    with _launcher_signals(processes) as received:
        try:
            _start(processes)
            for _, writer in pipes:
                writer.close()  # the workers hold their ends: a dead worker's pipe ends
            received.forward_preemption()  # to workers started after the signal came
            watch.until_done_or_failed(received)
        finally:
            stop(processes)
        watch.collect_reports(timeout=0.5)
    if received.stop_now is not None:
        raise watch.interruption(received.stop_now, received.grace_expired)
    failure = watch.failure()
    if failure is not None:
        raise failure
    preempted = watch.preempted(received.preempt)
    if preempted is not None:
        raise preempted


def _preload(target: Callable[..., None], target_args: tuple[Any, ...]) -> list[str]:
    """What the fork server imports before it forks a worker (torch with them): the modules of the worker's
    functions and the main module, the heavy part of every rank's start."""
    functions = [target, *(arg for arg in target_args if callable(arg))]
    return list(dict.fromkeys(["__main__", *(getattr(function, "__module__", None) or "__main__"
                                              for function in functions)]))


class _LauncherSignals:
    """The signals the launcher got: a preemption to forward, a request to stop now."""

    def __init__(self, processes: Sequence[mp.process.BaseProcess]) -> None:
        self.processes = processes
        self.preempt: Optional[int] = None
        self.stop_now: Optional[int] = None
        self.preempt_deadline = float("inf")
        self.grace_expired = False

    def record(self, signum: int, frame: Any) -> None:
        if signum in PREEMPT_SIGNALS and self.preempt is None:
            self.preempt = signum
            self.preempt_deadline = time.monotonic() + PREEMPT_GRACE_SECONDS
            self.forward_preemption()
        elif signum != signal.SIGUSR1:  # another SIGUSR1 changes nothing
            self.stop_now = signum

    def forward_preemption(self) -> None:
        if self.preempt is None:
            return
        for process in self.processes:
            if process.pid is not None and process.exitcode is None:
                _signal(process.pid, signal.SIGUSR1)

    def grace_is_over(self) -> bool:
        if time.monotonic() < self.preempt_deadline:
            return False
        self.stop_now, self.grace_expired = self.preempt, True
        return True


@contextmanager
def _launcher_signals(processes: Sequence[mp.process.BaseProcess]) -> Iterator[_LauncherSignals]:
    received = _LauncherSignals(processes)
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous = {signum: signal.signal(signum, received.record)
                for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield received
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _start(processes: Sequence[mp.process.BaseProcess]) -> None:
    """Start the workers as :func:`worker_start_state` says."""
    with worker_start_state():
        for process in processes:
            process.start()


@contextmanager
def worker_start_state() -> Iterator[None]:
    """SIGINT ignored and the worker signals blocked while workers start: Ctrl-C reaches the launcher only, and a
    signal that comes before a worker's handlers waits for them. The fork server, started by the first worker's
    start, inherits both across exec, and its children inherit them from it."""
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main_thread else None
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _WORKER_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        if in_main_thread:
            signal.signal(signal.SIGINT, previous)


def stop(processes: Sequence[mp.process.BaseProcess], grace: float = STOP_GRACE_SECONDS) -> None:
    """Send :data:`STOP_SIGNAL` to every live worker, SIGKILL those still alive after ``grace`` seconds, reap all."""
    started = [process for process in processes if process.pid is not None]
    for process in started:
        if process.exitcode is None:
            _signal(process.pid, STOP_SIGNAL)
    end = time.monotonic() + grace
    for process in started:
        process.join(max(0.0, end - time.monotonic()))
    for process in started:
        if process.exitcode is None:
            _signal(process.pid, signal.SIGKILL)
    for process in started:
        process.join()


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


class _Watch:
    """The launcher's view of its workers: who exited in which order, what each reported."""

    def __init__(self, processes: Sequence[mp.process.BaseProcess], readers: list[Connection],
                 first_rank: int) -> None:
        self.processes = list(processes)
        self.readers = dict(enumerate(readers))
        self.first_rank = first_rank
        self.reports: dict[int, WorkerReport] = {}
        self.exit_order: list[int] = []

    def until_done_or_failed(self, received: _LauncherSignals) -> None:
        while True:
            self._note_exits()
            failed = any(self.processes[i].exitcode not in _CLEAN_EXITS for i in self.exit_order)
            if received.stop_now is not None or failed or len(self.exit_order) == len(self.processes):
                return
            if received.grace_is_over():
                return
            waitables = [p.sentinel for p in self.processes if p.exitcode is None] + list(self.readers.values())
            ready = wait(waitables, timeout=_POLL_SECONDS)
            self._read([r for r in ready if isinstance(r, Connection)])

    def collect_reports(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while self.readers and time.monotonic() < end:
            self._read(wait(list(self.readers.values()), timeout=max(0.0, end - time.monotonic())))
        self._note_exits()

    def _note_exits(self) -> None:
        for index, process in enumerate(self.processes):
            if process.exitcode is not None and index not in self.exit_order:
                self.exit_order.append(index)

    def _read(self, ready: list[Any]) -> None:
        for index, reader in list(self.readers.items()):
            if reader not in ready:
                continue
            try:
                report = reader.recv()
            except (EOFError, OSError):
                del self.readers[index]
                continue
            if isinstance(report, WorkerReport):
                self.reports[index] = report

    def failure(self) -> Optional[HetfairError]:
        """The error of the worker that failed first, as one line."""
        for index in self.exit_order:
            code = self.processes[index].exitcode
            if code in _CLEAN_EXITS:
                continue
            rank = self.first_rank + index
            report = self.reports.get(index)
            if report is not None and report.exit_code != 0:
                error = DistributedError(report.message if report.job_wide else f"[rank {rank}] {report.message}")
                error.exit_code = report.exit_code
                return error
            error = DistributedError(f"the process of rank {rank} {_describe_exit(code)}; the others were stopped")
            error.exit_code = 1
            return error
        return None

    def preempted(self, signum: Optional[int]) -> Optional[Preempted]:
        """The lowest rank's account of a preemption (which update, where its checkpoint is)."""
        cause = signal.Signals(signum).name if signum is not None else "a signal to the worker processes"
        for index in sorted(self.reports):
            if self.reports[index].exit_code == PREEMPTED_EXIT_CODE:
                return Preempted(self.reports[index].message, cause)
        return None

    def interruption(self, signum: int, grace_expired: bool = False) -> Interrupted:
        """One line for a stop by signal; a worker's own account (e.g. of a save it cut short) wins."""
        detail = next((r.message for r in self.reports.values()
                       if r.exit_code == Interrupted.exit_code and r.message != "interrupted"), None)
        name = signal.Signals(signum).name
        stopped = f"stopped all {len(self.processes)} worker processes"
        if detail is None and grace_expired:
            detail = (f"the workers did not save and stop within {PREEMPT_GRACE_SECONDS:.0f}s of {name}; {stopped}")
        error = Interrupted(detail or f"interrupted by {name}; {stopped}")
        error.exit_code = 128 + signum
        return error


def _describe_exit(code: Optional[int]) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"

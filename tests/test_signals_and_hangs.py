"""No hang, no stray process: signals to the launcher, a rendezvous that never answers, a lone rank.

(SIGTERM and SIGUSR1 preempt a run: a save, then exit 75; see test_preemption.py.)

Real processes, real signals, real sockets on 127.0.0.1. Time bounds are the issue's own
("within 5 s", "the timeout plus a few seconds") with headroom for a loaded 2-core machine.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from helpers import (
    TOY_PLUGIN,
    LoopbackListener,
    child_pids,
    descendants,
    free_port,
    is_running,
    start,
    subprocess_env,
    train_command,
    worker_pids,
)

# generous for a loaded machine; the launcher itself needs at most ~2.5 s (SIGTERM, 2 s grace, SIGKILL)
STOP_BOUND_SECONDS = 15


def long_run(tmp_path: Path, *extra: str) -> list[str]:
    return ["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--toy-train-size", "100000", "--max-epoch", "50",
            "--save-dir", str(tmp_path / "ckpt"), "--log-format", "simple", "--log-interval", "20",
            "--disable-validation", "--save-interval-updates", "50", *extra]


def wait_for_line(proc: subprocess.Popen, marker: str, within: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        lines.append(line)
        if marker in line:
            return lines
        if not line and proc.poll() is not None:
            raise AssertionError(f"process ended before printing {marker!r}: {''.join(lines)}")
    raise AssertionError(f"no {marker!r} within {within} s")


def test_ctrl_c_to_the_launcher_stops_every_worker_with_one_line(tmp_path):
    launcher = start(long_run(tmp_path, "--distributed-world-size", "3"), tmp_path)
    try:
        wait_for_line(launcher, "train_inner", within=240)  # all three ranks are training
        workers = worker_pids(launcher.pid)
        assert len(workers) == 3
        os.kill(launcher.pid, signal.SIGINT)
        sent = time.monotonic()
        _, err = launcher.communicate(timeout=60)
        stopped_after = time.monotonic() - sent
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert not [pid for pid in workers if is_running(pid)]
    assert stopped_after < STOP_BOUND_SECONDS
    assert launcher.returncode == 130
    # progress lines printed between the line we waited for and the signal may come first
    assert [line for line in err.strip().splitlines() if not line.startswith("train_inner |")] == [
        "hetfair-train: interrupted by SIGINT; stopped all 3 worker processes"]


def test_a_crashed_worker_stops_the_others_with_one_line(tmp_path):
    launcher = start(long_run(tmp_path, "--distributed-world-size", "3"), tmp_path)
    try:
        wait_for_line(launcher, "train_inner", within=240)
        workers = worker_pids(launcher.pid)
        os.kill(workers[1], signal.SIGKILL)
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert not [pid for pid in workers if is_running(pid)]
    assert launcher.returncode == 1
    [line] = err.strip().splitlines()
    assert re.fullmatch(r"hetfair-train: error: the process of rank [0-2] was killed by signal SIGKILL; "
                        r"the others were stopped", line), line


def test_workers_stop_and_remove_the_jobs_store_when_their_launcher_is_killed(tmp_path):
    # where the launcher makes its private rendezvous directory: a short path, as TMPDIR also holds the fork
    # server's socket, whose path may not exceed 107 bytes (under tmp_path it did once pytest's run counter
    # had three digits and its workers' prefixes were added)
    temp = Path(tempfile.mkdtemp(prefix="hf-"))
    launcher = subprocess.Popen(train_command(*long_run(tmp_path, "--distributed-world-size", "2")), cwd=tmp_path,
                                env={**subprocess_env(), "TMPDIR": str(temp)}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        wait_for_line(launcher, "train_inner", within=240)
        workers = worker_pids(launcher.pid)
        assert len(workers) == 2
        left = descendants(launcher.pid)  # the workers, their fork server, the resource tracker
        assert [p.name for p in temp.glob("hetfair-rendezvous-*")]
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + STOP_BOUND_SECONDS
        while [pid for pid in left if is_running(pid)] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in left if is_running(pid)]  # none outlives the launcher
        assert not [p.name for p in temp.glob("hetfair-rendezvous-*")]
    finally:
        for pid in worker_pids(launcher.pid):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


def test_no_temporary_checkpoint_is_left_by_a_stop(tmp_path):
    launcher = start(long_run(tmp_path, "--distributed-world-size", "2", "--save-interval-updates", "1"), tmp_path)
    try:
        wait_for_line(launcher, "train_inner", within=240)  # saving after every update now
        os.kill(launcher.pid, signal.SIGINT)
        launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert not [p.name for p in (tmp_path / "ckpt").iterdir() if p.name.endswith(".tmp")]


def rank1_alone(tmp_path: Path, port: int, timeout: int) -> list[str]:
    return ["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--max-epoch", "1", "--save-dir", str(tmp_path / "c"),
            "--distributed-world-size", "2", "--distributed-rank", "1", "--distributed-gpus", "1",
            "--distributed-init-method", f"tcp://127.0.0.1:{port}", "--distributed-timeout", str(timeout)]


def test_a_rendezvous_that_accepts_and_never_answers_is_one_line_after_the_timeout(tmp_path):
    listener = LoopbackListener()
    timeout = 3
    try:
        began = time.monotonic()
        proc = start(rank1_alone(tmp_path, listener.port, timeout), tmp_path)
        _, err = proc.communicate(timeout=timeout + 120)
        elapsed = time.monotonic() - began
    finally:
        listener.close()
    assert listener.accepted  # it did get through to the silent listener
    assert proc.returncode == 2
    assert err.strip().splitlines() == [
        f"hetfair-train: error: [rank 1] rank 1 got no answer from the rendezvous tcp://127.0.0.1:{listener.port} "
        f"within {timeout}s; check that it is rank 0's address and that no other program listens there"]
    assert elapsed < timeout + 5 + 40  # the timeout, the 5 s grace, and start-up on a loaded machine


def test_a_lone_rank_1_is_one_line_after_the_timeout(tmp_path):
    timeout = 3
    port = free_port()
    began = time.monotonic()
    proc = start(rank1_alone(tmp_path, port, timeout), tmp_path)
    _, err = proc.communicate(timeout=timeout + 120)
    elapsed = time.monotonic() - began
    assert proc.returncode == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"hetfair-train: error: [rank 1] rank 1 could not reach rank 0 at 127.0.0.1:{port} "
                               f"within {timeout}s")
    assert elapsed < timeout + 40


def test_a_run_started_with_sigint_ignored_still_stops_on_sigint(tmp_path):
    # `hetfair-train ... &` in a shell script starts it with SIGINT ignored, inherited across exec
    proc = subprocess.Popen(train_command(*long_run(tmp_path)), cwd=tmp_path, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        wait_for_line(proc, "train_inner", within=240)
        os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=STOP_BOUND_SECONDS)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert [line for line in err.strip().splitlines() if not line.startswith("train_inner |")] == [
        "hetfair-train: interrupted"]


def test_ctrl_c_to_a_job_with_dataloader_workers_leaks_no_semaphore(tmp_path):
    # the toy plugin importable by name too, so that spawned DataLoader workers (before the fix) could load it
    env = {**subprocess_env(), "PYTHONPATH": str(TOY_PLUGIN.parent)}
    launcher = subprocess.Popen(train_command(*long_run(tmp_path, "--distributed-world-size", "4", "--num-workers", "2")),
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_line(launcher, "train_inner", within=240)
        os.kill(launcher.pid, signal.SIGINT)
        sent = time.monotonic()
        _, err = launcher.communicate(timeout=60)  # until every holder of its stderr (resource tracker too) is gone
        stopped_after = time.monotonic() - sent
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130, err
    assert "leaked semaphore" not in err
    assert [line for line in err.strip().splitlines() if not line.startswith("train_inner |")] == [
        "hetfair-train: interrupted by SIGINT; stopped all 4 worker processes"]
    assert stopped_after < STOP_BOUND_SECONDS


def test_dataloader_workers_of_ranks_load_a_user_dir_dataset(tmp_path):
    result = subprocess.run(train_command("--user-dir", str(TOY_PLUGIN), "--task", "toy", "--max-update", "3",
                                          "--max-sentences", "8", "--num-workers", "1", "--disable-validation",
                                          "--save-dir", str(tmp_path / "ckpt"), "--log-format", "none",
                                          "--distributed-world-size", "2"),
                            cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_the_dataloader_workers_of_a_killed_rank_die_with_it(tmp_path):
    log = (tmp_path / "stderr").open("w+")  # a file, not a pipe: waiting for the launcher waits for no orphan
    launcher = subprocess.Popen(train_command(*long_run(tmp_path, "--distributed-world-size", "2", "--num-workers", "2")),
                                cwd=tmp_path, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=log, text=True)
    try:
        deadline = time.monotonic() + 240
        while "train_inner" not in (tmp_path / "stderr").read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        rank = worker_pids(launcher.pid)[1]
        loaders = child_pids(rank)
        assert len(loaders) == 2
        os.kill(rank, signal.SIGKILL)
        launcher.wait(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    # torch's own watchdog would end them only seconds later (it looks every 5 s)
    assert not [pid for pid in loaders if is_running(pid)]


FINALIZER_STOP = """
import os, signal, sys, time
from hetfair.launch import supervisor

signal.signal(supervisor.STOP_SIGNAL, supervisor._stop_now)

class Closing:
    def __del__(self):  # a stop that arrives here (as in multiprocessing's Connection.__del__) ...
        os.kill(os.getpid(), supervisor.STOP_SIGNAL)
        time.sleep(0.2)
        print("finalizer done", flush=True)

try:
    Closing()
    time.sleep(5)
    print("not stopped", flush=True)
except KeyboardInterrupt:
    print("stopped", flush=True)  # ... stops the worker once the finalizer returns
"""


def test_a_stop_that_arrives_in_a_finalizer_is_not_lost(tmp_path):
    """Python prints and drops an exception raised inside ``__del__``: a worker's stop raised there would be
    lost (the worker runs on until SIGKILL) and its traceback would reach the user's terminal."""
    result = subprocess.run([sys.executable, "-c", FINALIZER_STOP], capture_output=True, text=True, timeout=60,
                            env=subprocess_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["finalizer", "done", "stopped"], result.stdout
    assert result.stderr == ""

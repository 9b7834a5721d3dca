"""--fault-tolerance live: ranks are lost (SIGKILL, SIGSTOP) and replaced while the others train on.

Real processes on 127.0.0.1: a lighthouse and one hetfair-train command per rank, gloo. Every scenario
ends with the parameters of an uninterrupted plain-PyTorch run of the same updates (tests/toy_reference.py,
no dropout, fp32): a dropped update is trained again and the global batch never changes. The tests wait
for log lines, never for time; runs that end early are ended by SIGTERM (preemption), which stops every
rank after the same update with a checkpoint. ``benchmarks/stress_live.py`` repeats them.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from helpers import final_parameters, subprocess_env, train_command
from hetfair.checkpoint.layout import load_checkpoint
from hetfair_cli.train import main as train_main
from test_mnist_plugin import needs_fashion_mnist
from test_readme_recipes import assert_both_succeeded, checkout, page_block, run_pair, two_nodes  # noqa: F401
from toy_reference import assert_same, reference_parameters, toy_train_args

TRAIN_SIZE = 100_000  # no epoch ends while the tests run
STOPPED_TIMEOUT = "3"  # short: the stopped rank is dropped after it
LOST_TIMEOUT = "5"  # a survivor stuck in a collective with the other survivor (not the lost rank) waits this long
SLOW_LR = 0.05
WAIT = 150.0  # seconds any one log line may take on a loaded machine before the test fails
PREEMPTED = 75
JOB_ENDED_WITHOUT_IT = 3
NATIVE_LOG = re.compile(r"^\[|^frame #|^Exception raised from|^terminate called")
"""A line of torch's C++ logs (``[W1201 ... TCPStore.cpp:125] ...``, its frames) or of an abort."""


class Process:
    """A running command whose stderr lines are collected by a thread, to wait for one that matches."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # type: ignore[union-attr]

    def _read(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, pattern: str, after: int = 0) -> int:
        """The index of the first line from ``after`` on that matches ``pattern``; fails if the process ends first."""
        regex = re.compile(pattern)
        with self._changed:
            while True:
                found = next((i for i in range(after, len(self.lines)) if regex.search(self.lines[i])), None)
                if found is not None:
                    return found
                if self.proc.poll() is not None and not self._changed.wait(1.0):
                    raise AssertionError(f"ended ({self.proc.returncode}) before {pattern!r}:\n" + self.text())
                if not self._changed.wait(WAIT):
                    raise AssertionError(f"no {pattern!r} within {WAIT}s:\n" + self.text())

    def rank_in(self, round_number: int) -> int:
        line = self.lines[self.wait_for(rf"live \| round {round_number}: rank \d+ of")]
        return int(re.search(r"rank (\d+) of", line).group(1))  # type: ignore[union-attr]

    def text(self) -> str:
        return "\n".join(self.lines[-40:])

    def native_lines(self) -> list[str]:
        return [line for line in self.lines if NATIVE_LOG.search(line)]


LIGHTHOUSE = [sys.executable, "-m", "hetfair_cli.lighthouse"]


def listening_port(proc: subprocess.Popen) -> int:
    """The port a lighthouse says it listens on (the lines before, if any, are not that line)."""
    seen = []
    for line in proc.stderr:  # type: ignore[union-attr]
        port = re.search(r"listening on port (\d+)", line)
        if port:
            return int(port.group(1))
        seen.append(line)
    raise AssertionError(f"the lighthouse ended ({proc.wait()}) without listening:\n{''.join(seen)}")


@contextmanager
def lighthouse_process(*prefix: str, host: str = "127.0.0.1", port: int = 0) -> Iterator[tuple[str, subprocess.Popen]]:
    """A lighthouse (run by the command ``prefix``, e.g. in a network namespace) on ``host``: its address and process."""
    flags = ["--port", str(port)] + (["--host", host] if host != "127.0.0.1" else [])  # loopback is the default
    proc = subprocess.Popen([*prefix, *LIGHTHOUSE, *flags], env=subprocess_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        yield f"tcp://{host}:{listening_port(proc)}", proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def lighthouse() -> Iterator[str]:
    with lighthouse_process() as (address, _):
        yield address


class Job:
    """The rank commands of one live job; every one still running is killed at the end."""

    def __init__(self, tmp_path: Path, lighthouse: str, live_timeout: str, *extra: str) -> None:
        self.save_dir = tmp_path / "ckpt"
        self.cwd = tmp_path
        self.common = toy_train_args(self.save_dir, None, (
            "--toy-train-size", str(TRAIN_SIZE), "--log-format", "simple", "--log-interval", "1",
            "--fault-tolerance", "live", "--live-timeout", live_timeout, "--distributed-world-size", "3",
            "--distributed-init-method", lighthouse, *extra))
        self.processes: list[Process] = []

    def start(self, batch: int, *extra: str, host=None, env: dict[str, str] | None = None) -> Process:
        """A rank with ``batch``, on ``host`` (a namespace of tests/netns.py; default: this one), in ``env``."""
        command = train_command(*self.common, "--max-sentences", str(batch), *extra)
        process = Process(subprocess.Popen(host.command(*command) if host else command, cwd=self.cwd,
                                           env=env or subprocess_env(), stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True))
        self.processes.append(process)
        return process

    def by_rank(self, processes: list[Process], round_number: int) -> list[Process]:
        return sorted(processes, key=lambda process: process.rank_in(round_number))

    def close(self) -> None:
        """Kill what still runs; every process's last lines go to stderr (pytest shows them when a test failed)."""
        for index, process in enumerate(self.processes):
            if process.proc.poll() is None:
                process.proc.kill()
            process.proc.wait(timeout=30)
            print(f"-- process {index} ({process.proc.returncode}):", process.text(), sep="\n", file=sys.stderr)

    def assert_quiet(self) -> None:
        """No rank printed a line of torch's C++ logs (every one of them is filtered or discarded)."""
        for process in self.processes:
            assert not process.native_lines(), process.text()


def _updates_after(master: Process, line: int, count: int = 2) -> int:
    """Wait until ``master`` logs ``count`` more updates after its line ``line``; the index of the last."""
    for _ in range(count):
        line = master.wait_for(r"^train_inner .*num_updates \d+ ", after=line + 1)
    return line


def _preempt_all(processes: list[Process]) -> None:
    for process in processes:
        os.kill(process.proc.pid, signal.SIGTERM)
    for process in processes:
        assert process.proc.wait(timeout=WAIT) == PREEMPTED, process.text()


def _lose_and_replace(tmp_path: Path, lighthouse: str, lost_rank: int, batches: tuple[int, ...], *extra: str) -> None:
    """Kill rank ``lost_rank`` of 3 after update 5, start a replacement once the other two train, end by SIGTERM
    after the three trained together. The parameters are those of the same updates without a failure.

    The survivors train on while the replacement starts (seconds, hundreds of updates): slow updates
    (``--toy-step-seconds``) and a small learning rate keep the float rounding of that many updates, which an
    exact but differently split sum still has, within the tolerance."""
    job = Job(tmp_path, lighthouse, LOST_TIMEOUT, "--global-batch-size", "16", "--toy-step-seconds", "0.01",
              "--lr", str(SLOW_LR), *extra)
    try:
        ranks = job.by_rank([job.start(batch) for batch in batches], 1)
        ranks[0].wait_for(r"num_updates 5 ")
        lost = ranks.pop(lost_rank)
        lost.proc.kill()
        master = ranks[0]
        _updates_after(master, master.wait_for(r"live \| round 2: rank 0 of 2 \(2 of 3 kept\)"))
        assert ranks[1].rank_in(2) == 1
        replacement = job.start(batches[lost_rank])
        assert replacement.rank_in(3) == 2
        assert re.search(r"round 3: rank 2 of 3 \(2 of 2 kept\) from update \d+, state of rank 0",
                         replacement.text())
        _updates_after(master, master.wait_for(r"live \| round 3: rank 0 of 3"))
        _preempt_all([*ranks, replacement])
        job.assert_quiet()
    finally:
        job.close()
    updates = load_checkpoint(job.save_dir / "checkpoint_last.pt")["trainer"]["num_updates"]
    assert updates > 5
    expected = reference_parameters(16, train_size=TRAIN_SIZE, updates=updates, lr=SLOW_LR)
    assert_same(final_parameters(job.save_dir), expected)


def test_a_killed_rank_is_replaced_and_the_run_ends_as_an_uninterrupted_one(tmp_path, lighthouse):
    # heterogeneous batch sizes, auto-balanced: the split is made anew for 2 and for 3 ranks
    _lose_and_replace(tmp_path, lighthouse, 2, (8, 4, 4), "--auto-balance")


def test_the_state_donor_killed_the_next_rank_leads_and_hands_the_state_to_the_replacement(tmp_path, lighthouse):
    # rank 0 gives the state and writes the checkpoints: rank 1 takes over both
    _lose_and_replace(tmp_path, lighthouse, 0, (4, 4, 4))


def test_a_stopped_rank_is_dropped_after_the_live_timeout_and_the_others_finish(tmp_path, lighthouse):
    """...and the stopped rank, continued after the job ended, ends with its own exit code and one line."""
    job = Job(tmp_path, lighthouse, STOPPED_TIMEOUT, "--max-update", "30")
    try:
        ranks = job.by_rank([job.start(4) for _ in range(3)], 1)
        ranks[0].wait_for(r"num_updates 5 ")
        os.kill(ranks[1].proc.pid, signal.SIGSTOP)
        master = ranks[0]
        master.wait_for(r"live \| round 2: rank 0 of 2 \(2 of 3 kept\) from update \d+")
        assert master.proc.wait(timeout=WAIT) == 0, master.text()
        assert ranks[2].proc.wait(timeout=WAIT) == 0, ranks[2].text()
        master.wait_for(r"^done \| num_updates 30 ")
        os.kill(ranks[1].proc.pid, signal.SIGCONT)
        assert ranks[1].proc.wait(timeout=WAIT) == JOB_ENDED_WITHOUT_IT, ranks[1].text()
        ranks[1].wait_for(r"^hetfair-train: error: the job at this lighthouse ended without this process: it was "
                          r"dropped after round 1 \(no answer for --live-timeout 3s\)")
        job.assert_quiet()
    finally:
        job.close()
    # 12 samples per update (3 x 4) from the first round on: the two survivors take two steps each
    assert_same(final_parameters(job.save_dir), reference_parameters(12, train_size=TRAIN_SIZE, updates=30))


def _one_line_stop(process: Process, why: str, save_dir: Path, samples_per_update: int) -> None:
    """``process`` ended with one ``hetfair-train: error:`` line naming ``why``, and its checkpoint holds the
    parameters of an uninterrupted run of as many updates."""
    assert process.proc.wait(timeout=WAIT) == 2, process.text()
    errors = [line for line in process.lines if line.startswith("hetfair-train: error:")]
    assert len(errors) == 1 and re.search(why + r": stopped after update \d+; saved .*checkpoint_last.pt", errors[0])
    assert not any(line.startswith("Traceback") for line in process.lines), process.text()
    updates = int(re.search(r"stopped after update (\d+)", errors[0]).group(1))  # type: ignore[union-attr]
    assert load_checkpoint(save_dir / "checkpoint_last.pt")["trainer"]["num_updates"] == updates >= 5
    expected = reference_parameters(samples_per_update, train_size=TRAIN_SIZE, updates=updates)
    assert_same(final_parameters(save_dir), expected)


def test_losing_a_majority_ends_the_job_with_one_line_and_a_checkpoint(tmp_path, lighthouse):
    job = Job(tmp_path, lighthouse, STOPPED_TIMEOUT)
    try:
        ranks = job.by_rank([job.start(4) for _ in range(3)], 1)
        ranks[0].wait_for(r"num_updates 5 ")
        for lost in ranks[1:]:
            lost.proc.kill()
        _one_line_stop(ranks[0], r"lost a majority of the ranks \(1 of 3 came back in round \d+\)", job.save_dir, 12)
        job.assert_quiet()
    finally:
        job.close()


def test_losing_the_lighthouse_ends_the_job_with_one_line_and_a_checkpoint(tmp_path):
    with lighthouse_process() as (address, keeper):
        job = Job(tmp_path, address, STOPPED_TIMEOUT, "--distributed-world-size", "2")
        try:
            ranks = job.by_rank([job.start(4) for _ in range(2)], 1)
            ranks[0].wait_for(r"num_updates 5 ")
            keeper.kill()
            _one_line_stop(ranks[0], r"lost the lighthouse tcp://127.0.0.1:\d+ \(.*\)", job.save_dir, 8)
            assert ranks[1].proc.wait(timeout=WAIT) == 2, ranks[1].text()
            job.assert_quiet()
        finally:
            job.close()


@pytest.mark.parametrize("flags,message", [
    (("--ddp-backend", "fully_sharded"), "does not support --ddp-backend fully_sharded: a lost rank's parameter "
                                         "shards cannot be rebuilt from the others"),
    (("--ddp-backend", "diloco"), "does not support --ddp-backend diloco: the outer loop"),
    (("--zero-sharding", "os"), "does not support --zero-sharding os: a lost rank's optimizer shard cannot be "
                                "rebuilt from the others"),
    (("--distributed-init-method", "file:///tmp/x"), "needs --distributed-init-method tcp://HOST:PORT, the address "
                                                     "of the lighthouse"),
    (("--max-sentences", "4,4"), "runs one process per command"),
])
def test_modes_live_recovery_cannot_keep_are_refused_in_one_line(tmp_path, capsys, flags, message):
    args = toy_train_args(tmp_path / "ckpt", None, ("--fault-tolerance", "live", "--distributed-world-size", "2",
                                                    "--distributed-init-method", "tcp://127.0.0.1:1", *flags))
    assert train_main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hetfair-train: error: --fault-tolerance live ") and message in err


def test_no_lighthouse_is_one_line_after_the_timeout_and_its_advice_starts_one(tmp_path):
    with socket.socket() as closed:  # a free port, closed again: nothing listens there
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    job = Job(tmp_path, f"tcp://127.0.0.1:{port}", "3", "--distributed-timeout", "2", "--distributed-world-size", "1",
              "--max-update", "3")
    try:
        rank = job.start(4)
        assert rank.proc.wait(timeout=WAIT) == 2, rank.text()
        rank.wait_for(".")
        assert rank.lines == [f"hetfair-train: error: could not reach the lighthouse at 127.0.0.1:{port} within 2s "
                              f"(Connection refused); start it first (hetfair-lighthouse --host 127.0.0.1 --port "
                              f"{port}, on that machine) or check --distributed-init-method"], rank.text()
        advice = re.search(r"start it first \((hetfair-lighthouse [^,]+),", rank.lines[0]).group(1)  # type: ignore
        script = Path(sys.executable).with_name("hetfair-lighthouse")  # the console script, as typed
        lighthouse = subprocess.Popen([str(script), *advice.split()[1:]], env=subprocess_env(),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            assert listening_port(lighthouse) == port
            again = job.start(4)
            assert again.proc.wait(timeout=WAIT) == 0, again.text()
            again.wait_for(r"^done \| num_updates 3 ")
        finally:
            lighthouse.terminate()
            lighthouse.wait(timeout=30)
    finally:
        job.close()


@needs_fashion_mnist
def test_the_live_two_node_recipe_runs_as_typed(two_nodes, checkout):
    scripts = (page_block("# node A, live, batch 48: the job's secret, the lighthouse, then one rank"),
               page_block("# node B, live, batch 16: the secret node A printed, then one rank"))
    err = assert_both_succeeded(run_pair(two_nodes, scripts, checkout, secret_from_a=True))
    assert ("per-rank batch rank 0: 48, rank 1: 16 |" in err) != ("per-rank batch rank 0: 16, rank 1: 48 |" in err), err
    assert "done | num_updates 10 |" in err, err  # 576 training images, 64 per update: 9 and a part
    assert not [line for line in err.splitlines() if NATIVE_LOG.search(line)], err
    assert (checkout / "checkpoints" / "live" / "checkpoint_last.pt").exists()

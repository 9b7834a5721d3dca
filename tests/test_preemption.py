"""Preemption: SIGTERM or SIGUSR1 makes a run finish its update, save checkpoint_last.pt and exit 75,
and resuming it ends exactly where an uninterrupted run ends. Real processes and signals, gloo on 127.0.0.1."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
import torch

import agreement_worker
from helpers import TOY_PLUGIN, final_parameters, free_port, is_running, start, worker_pids
from hetfair.checkpoint.layout import load_checkpoint
from hetfair.launch import preemption
from hetfair.launch.launcher import launch
from hetfair.options import parse_train_args
from hetfair_cli.errors import run_cli
from hetfair_cli.train import main as train_main
from hetfair.launch.supervisor import run_workers
from hetfair.parallel.context import DistributedContext

PREEMPTED = 75


def toy_args(save_dir: Path, max_update: int, *extra: str) -> list[str]:
    return ["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--toy-train-size", "100000", "--save-dir", str(save_dir),
            "--max-update", str(max_update), "--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.05",
            "--lr-scheduler", "polynomial_decay", "--warmup-updates", "3", "--total-num-update", "100000",
            "--disable-validation", "--no-epoch-checkpoints", "--log-format", "simple", "--log-interval", "5", *extra]


def preempt_after_a_few_updates(args: list[str], cwd: Path, signum: int) -> tuple[subprocess.Popen, list[str]]:
    """Start hetfair-train, send ``signum`` once it has logged update 5, wait for it to end."""
    proc = start(args, cwd)
    try:
        for line in proc.stderr:
            if "num_updates 5 " in line:
                break
        os.kill(proc.pid, signum)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, err.strip().splitlines()


def assert_same_parameters(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=1e-5)


def check_preempted(proc: subprocess.Popen, lines: list[str], signum: int, save_dir: Path) -> int:
    """The one-line account and the checkpoint of a preempted run; returns its update count."""
    assert proc.returncode == PREEMPTED, lines
    last = save_dir / "checkpoint_last.pt"
    match = re.fullmatch(rf"hetfair-train: preempted by {signal.Signals(signum).name}: stopped after update "
                         rf"(\d+) \(epoch 1\); saved {re.escape(str(last))}; run the same command to resume", lines[-1])
    assert match, lines[-1]
    assert not [line for line in lines if "Traceback" in line or "error" in line]
    done = int(match.group(1))
    assert load_checkpoint(last)["trainer"]["num_updates"] == done >= 5
    return done


def test_a_preempted_run_saves_and_resumes_exactly(tmp_path):
    preempted = tmp_path / "preempted"
    proc, lines = preempt_after_a_few_updates(toy_args(preempted, 100000), tmp_path, signal.SIGTERM)
    done = check_preempted(proc, lines, signal.SIGTERM, preempted)

    end = done + 6
    assert train_main(toy_args(preempted, end, "--log-format", "none")) == 0
    uninterrupted = tmp_path / "uninterrupted"
    assert train_main(toy_args(uninterrupted, end, "--log-format", "none")) == 0
    assert_same_parameters(final_parameters(preempted), final_parameters(uninterrupted))


def test_a_preempted_two_rank_job_stops_together_saves_and_resumes_exactly(tmp_path):
    preempted = tmp_path / "preempted"
    two_ranks = ("--distributed-world-size", "2", "--max-sentences", "8")
    launcher_args = toy_args(preempted, 100000, *two_ranks)
    proc = start(launcher_args, tmp_path)
    try:
        for line in proc.stderr:
            if "num_updates 5 " in line:
                break
        workers = worker_pids(proc.pid)
        assert len(workers) == 2
        os.kill(proc.pid, signal.SIGUSR1)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not [pid for pid in workers if is_running(pid)]
    done = check_preempted(proc, err.strip().splitlines(), signal.SIGUSR1, preempted)

    end = done + 4
    assert train_main(toy_args(preempted, end, *two_ranks, "--log-format", "none")) == 0
    one_process = tmp_path / "one_process"  # the same global batch of 16 on one process
    assert train_main(toy_args(one_process, end, "--max-sentences", "16", "--log-format", "none")) == 0
    assert_same_parameters(final_parameters(preempted), final_parameters(one_process))


@pytest.mark.parametrize("riding", [False, True], ids=["own all-reduce", "on the stats all-reduce"])
def test_ranks_signalled_at_different_updates_stop_after_the_same_one(tmp_path, riding):
    run_workers(agreement_worker.WORLD_SIZE, 0, agreement_worker.run_rank,
                (f"tcp://127.0.0.1:{free_port()}", str(tmp_path), riding))
    stops = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(agreement_worker.WORLD_SIZE)]
    first_signal = min(agreement_worker.SIGNALLED_AT.values())
    assert stops == [first_signal + 1] * agreement_worker.WORLD_SIZE  # the vote cast after it is read one later


def test_a_vote_that_rode_on_the_stats_decides_without_a_collective_of_its_own():
    # two ranks but no process group: an all-reduce of the agreement's own would raise
    agreement = preemption.StopAgreement(DistributedContext(0, 2, 0, torch.device("cpu")))
    agreement.arrive({"stop": 0.0, "regroup": 0.0})
    assert not agreement.poll() and not agreement.regroup
    agreement.arrive({"stop": 1.0, "regroup": 0.0})
    assert agreement.poll()
    agreement.arrive({"stop": 0.0, "regroup": 2.0})
    assert not agreement.poll() and agreement.regroup


def test_the_first_sigterm_asks_to_stop_and_a_second_stops_at_once():
    with preemption.preemptible():
        assert preemption.requested_by() is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.requested_by() == signal.SIGTERM  # the handler ran between bytecodes
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
        assert interrupted
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_sigusr1_then_sigterm_is_one_request_not_a_stop():
    # a worker under torchrun or SLURM gets SIGTERM itself and SIGUSR1 from its launcher, in either order
    with preemption.preemptible():
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.requested_by() == signal.SIGUSR1


def test_a_second_sigterm_to_a_single_process_exits_with_the_launchers_code(tmp_path, capsys):
    def train(args, context) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # preempt: finish the update, save
        os.kill(os.getpid(), signal.SIGTERM)  # stop now

    def main(argv: list[str]) -> int:
        launch(parse_train_args(argv), train)
        return 0

    args = ["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--save-dir", str(tmp_path)]
    assert run_cli("hetfair-train", main, args) == 128 + signal.SIGTERM == 143  # as the launcher's stop by SIGTERM
    assert capsys.readouterr().err == "hetfair-train: interrupted by SIGTERM\n"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

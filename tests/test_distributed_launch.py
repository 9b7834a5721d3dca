"""Start-up without MPI: local spawning, multi-node commands, torchrun, SLURM, failures.

Every test runs real gloo process groups on 127.0.0.1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forked_cli import start_forked
from helpers import TOY_PLUGIN, final_parameters, free_port, run_nodes, start, subprocess_env
from hetfair_cli.train import main as train_main
from toy_reference import assert_same, reference_parameters, toy_train_args


def test_single_node_spawns_processes_without_an_init_method(tmp_path):
    save_dir = tmp_path / "ckpt"
    args = toy_train_args(save_dir, 1) + ["--max-sentences", "8", "--distributed-world-size", "4"]
    [result] = run_nodes([args], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert_same(final_parameters(save_dir), reference_parameters(update_size=32))


def test_two_node_commands_with_several_processes_each(tmp_path):
    """HetSeq's two-node example: ranks 0 and 4 of a world of 8, four processes per command."""
    save_dir = tmp_path / "ckpt"
    init = f"tcp://127.0.0.1:{free_port()}"
    nodes = []
    for first_rank, batch in ((0, "2"), (4, "6")):
        nodes.append(toy_train_args(save_dir, 1) + [
            "--max-sentences", batch, "--distributed-world-size", "8", "--distributed-rank", str(first_rank),
            "--distributed-gpus", "4", "--distributed-init-method", init])
    for result in run_nodes(nodes, cwd=tmp_path, timeout=300):
        assert result.returncode == 0, result.stderr
    assert_same(final_parameters(save_dir), reference_parameters(update_size=4 * 2 + 4 * 6))


def test_torchrun_environment(tmp_path):
    save_dir = tmp_path / "ckpt"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
               "-m", "hetfair_cli.train", *toy_train_args(save_dir, 1), "--max-sentences", "16"]
    result = subprocess.run(command, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert_same(final_parameters(save_dir), reference_parameters(update_size=32))


def run_slurm_tasks(tmp_path: Path, tasks: list[tuple[dict[str, str], str]]) -> Path:
    """Start the toy job once per ``(SLURM variables, --max-sentences)`` as srun would (each a forked command
    with its own environment), one epoch; its save dir."""
    save_dir = tmp_path / "ckpt"
    port = free_port()
    procs = [start_forked(toy_train_args(save_dir, 1) + ["--max-sentences", batch, "--distributed-port", str(port)],
                          tmp_path, {**subprocess_env(), **slurm_env})
             for slurm_env, batch in tasks]
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
    return save_dir


@pytest.mark.parametrize("batches", [("12", "20"), ("12,20", "12,20")], ids=["own-values", "one-list"])
def test_slurm_environment(tmp_path, batches):
    """Under srun every task runs the same command: a per-process list gives each task of the node its
    SLURM_LOCALID's value."""
    tasks = [({"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0",
               "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "127.0.0.1", "SLURM_TASKS_PER_NODE": "2"}, batch)
             for rank, batch in enumerate(batches)]
    assert_same(final_parameters(run_slurm_tasks(tmp_path, tasks)), reference_parameters(update_size=32))


def test_slurm_two_nodes_with_their_own_batch_sizes_from_one_command(tmp_path):
    """srun on two nodes, one task each, every task the same command: ``12:20`` is 12 on node 0, 20 on node 1."""
    tasks = [({"SLURM_PROCID": str(node), "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": str(node),
               "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "127.0.0.1,127.0.0.2",
               "SLURM_TASKS_PER_NODE": "1(x2)"}, "12:20") for node in (0, 1)]
    assert_same(final_parameters(run_slurm_tasks(tmp_path, tasks)), reference_parameters(update_size=32))


def test_values_per_node_need_slurm_to_say_which_node_this_is(tmp_path, capsys):
    code = train_main(toy_train_args(tmp_path / "c", 1) + ["--max-sentences", "12:20"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "hetfair-train: error: --max-sentences 12:20 gives one value per node, which needs SLURM (its SLURM_NODEID "
        "says which node this is); give each node's command its own value"]


def test_mismatched_world_size_is_a_clear_error(tmp_path):
    init = f"tcp://127.0.0.1:{free_port()}"
    nodes = [
        toy_train_args(tmp_path / "c", 1) + ["--distributed-world-size", "2", "--distributed-rank", "0",
                                             "--distributed-gpus", "1", "--distributed-init-method", init],
        toy_train_args(tmp_path / "c", 1) + ["--distributed-world-size", "3", "--distributed-rank", "1",
                                             "--distributed-gpus", "1", "--distributed-init-method", init],
    ]
    began = time.monotonic()
    results = run_nodes(nodes, cwd=tmp_path, timeout=120)
    assert time.monotonic() - began < 50  # well before the 60 s --distributed-timeout
    for result in results:
        assert result.returncode != 0
        assert "--distributed-world-size 3 but rank 0 with 2" in result.stderr
        assert "Traceback" not in result.stderr


def test_a_rank_that_never_arrives_is_reported_after_the_timeout(tmp_path):
    args = toy_train_args(tmp_path / "c", 1) + [
        "--distributed-world-size", "2", "--distributed-rank", "0", "--distributed-gpus", "1",
        "--distributed-init-method", f"tcp://127.0.0.1:{free_port()}", "--distributed-timeout", "2"]
    began = time.monotonic()
    [result] = run_nodes([args], cwd=tmp_path, timeout=120)
    assert result.returncode != 0
    assert "only 1 of 2 processes joined" in result.stderr
    assert time.monotonic() - began < 2 + 30
    assert "Traceback" not in result.stderr


def test_a_killed_rank_makes_the_others_exit_with_a_clear_message(tmp_path):
    init = f"tcp://127.0.0.1:{free_port()}"
    timeout = 20
    common = ["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--toy-train-size", "100000", "--max-epoch", "50",
              "--save-dir", str(tmp_path / "ckpt"), "--log-format", "simple", "--log-interval", "20",
              "--disable-validation", "--no-save", "--distributed-world-size", "2", "--distributed-gpus", "1",
              "--distributed-init-method", init, "--distributed-timeout", str(timeout)]
    survivor = start(common + ["--distributed-rank", "0"], tmp_path)
    victim = start(common + ["--distributed-rank", "1"], tmp_path)
    try:
        _wait_for_line(survivor, "train_inner", within=120)  # both ranks are training now
        os.kill(victim.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        _, err = survivor.communicate(timeout=timeout + 60)
    finally:
        for proc in (survivor, victim):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert survivor.returncode != 0
    assert time.monotonic() - killed_at < timeout + 30
    assert "lost contact with the other ranks" in err
    assert "Traceback" not in err


def _wait_for_line(proc: subprocess.Popen, marker: str, within: float) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if marker in line:
            return
        if not line and proc.poll() is not None:
            raise AssertionError(f"process ended before printing {marker!r}")
    raise AssertionError(f"no {marker!r} within {within} s")


def test_spawned_process_failure_ends_the_command(tmp_path):
    """A user error inside spawned workers: one line for the whole job, exit code 2, no hang."""
    args = ["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--distributed-world-size", "2", "--max-epoch", "1",
            "--save-dir", str(tmp_path / "c"), "--max-tokens", "100", "--log-format", "none"]
    [result] = run_nodes([args], cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()  # one line for the job, not one per rank
    assert line.startswith("hetfair-train: error: [rank ") and "has no fixed sample length" in line


def test_rank_beyond_the_world_is_a_clear_error(tmp_path):
    args = ["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--distributed-world-size", "4",
            "--distributed-rank", "3", "--distributed-gpus", "2", "--distributed-init-method",
            f"file://{tmp_path / 'rdv'}", "--save-dir", str(tmp_path / "c"), "--max-epoch", "1"]
    [result] = run_nodes([args], cwd=Path(tmp_path), timeout=60)
    assert result.returncode == 2
    assert "ranks 3..4" in result.stderr and "Traceback" not in result.stderr


def test_a_file_store_in_a_missing_directory_stops_before_any_process_starts(tmp_path, capsys):
    began = time.monotonic()
    code = train_main(toy_train_args(tmp_path / "c", 1) + [
        "--distributed-world-size", "2", "--distributed-gpus", "2",
        "--distributed-init-method", f"file://{tmp_path}/missing/store"])
    assert time.monotonic() - began < 5
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"hetfair-train: error: --distributed-init-method file://{tmp_path}/missing/store: directory does not "
        f"exist; create it (on a file system every node shares) or give another path"]

"""One update is the same update whatever the cluster's shape.

Runs real gloo process groups (each 'node' a separate hetfair-train command
with its own --max-sentences) and compares the final parameters against a
plain PyTorch loop over the same global batches.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import TOY_PLUGIN, final_parameters, free_port, node_commands, run_nodes
from hetfair_cli.train import main as train_main
from toy_reference import TRAIN_SIZE, assert_same, reference_parameters, toy_train_args


def run_cluster(tmp_path: Path, batch_sizes: list[int], update_freq: int, init: str,
                extra: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """One command per rank, each with its own --max-sentences, meeting through ``init``."""
    save_dir = tmp_path / f"ckpt_{'_'.join(map(str, batch_sizes))}_uf{update_freq}_{init}"
    if init == "file":
        init_method = f"file://{tmp_path / ('rendezvous_' + save_dir.name)}"
    else:
        init_method = f"tcp://127.0.0.1:{free_port()}"
    commands = node_commands(toy_train_args(save_dir, update_freq, extra), batch_sizes, init_method)
    for result in run_nodes(commands, cwd=tmp_path):
        assert result.returncode == 0, result.stderr
    return final_parameters(save_dir)


@pytest.mark.parametrize(
    "batch_sizes,update_freq,init",
    [
        ([32], 1, "tcp"),
        ([8, 24], 1, "file"),
        ([2, 6, 8, 16], 1, "tcp"),
        ([8, 24], 2, "tcp"),
        ([2, 6, 8, 16], 2, "file"),
        ([16], 2, "tcp"),
    ],
)
def test_cluster_shape_does_not_change_the_update(tmp_path, batch_sizes, update_freq, init):
    expected = reference_parameters(update_size=sum(batch_sizes) * update_freq)
    assert_same(run_cluster(tmp_path, batch_sizes, update_freq, init), expected)


def test_one_command_may_give_each_of_its_processes_its_own_batch_size(tmp_path):
    save_dir = tmp_path / "ckpt"
    args = toy_train_args(save_dir, 1) + ["--distributed-world-size", "3", "--max-sentences", "2,6,24"]
    for result in run_nodes([args], cwd=tmp_path):
        assert result.returncode == 0, result.stderr
    assert_same(final_parameters(save_dir), reference_parameters(update_size=32))


def test_gradient_clipping_uses_the_global_norm(tmp_path):
    clip = 0.05  # small enough that most updates are clipped
    expected = reference_parameters(update_size=32, clip_norm=clip)
    actual = run_cluster(tmp_path, [4, 12, 16], 1, "tcp", extra=("--clip-norm", str(clip)))
    assert_same(actual, expected)


def test_reference_is_sensitive_to_the_update_size():
    """Guards the tests above: a different global batch gives different parameters."""
    a, b = reference_parameters(32), reference_parameters(64)
    assert not all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5) for k in a)


def test_a_rank_with_no_samples_still_joins(tmp_path):
    """The last global batch (8 samples) leaves rank 0 of caps 1/31 empty; training still matches."""
    assert math.ceil(TRAIN_SIZE / 32) * 32 - TRAIN_SIZE == 24
    expected = reference_parameters(update_size=32)
    assert_same(run_cluster(tmp_path, [1, 31], 1, "tcp"), expected)


LONG_RUN_WINDOW = 25  # updates per train_inner line: each line's loss is the mean over its window


def windowed_losses(log: str) -> list[float]:
    records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    return [record["loss"] for record in records if record["phase"] == "train_inner"]


def test_long_runs_on_two_shapes_agree_closer_than_two_seeds(tmp_path, capsys):
    """1 x 64 and 2 x 32 take the same updates up to float summation order, which training amplifies
    (benchmarks/bench_long_run_shapes.py: the parameters drift apart over ~1000 updates). What stays is
    the training itself: the shapes' loss curves must differ less than those of two seeds of one shape,
    the spread of "the same run, other random choices". A change of the update's meaning (a
    reweighting, a lost or doubled sample) moves the curve by more than float rounding does."""
    def train(seed: int, batch_sizes: list[int]) -> list[float]:
        args = ["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--toy-train-size", "6400", "--seed", str(seed),
                "--max-epoch", "0", "--max-update", "300", "--log-format", "json", "--log-interval",
                str(LONG_RUN_WINDOW), "--disable-validation", "--no-save", "--distributed-timeout", "60",
                "--max-sentences", ",".join(map(str, batch_sizes)), "--distributed-world-size", str(len(batch_sizes))]
        if len(batch_sizes) == 1:  # in this process: no start-up to pay
            capsys.readouterr()
            assert train_main(args) == 0
            return windowed_losses(capsys.readouterr().err)
        [result] = run_nodes([args], cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        return windowed_losses(result.stderr)

    def distance(a: list[float], b: list[float]) -> float:
        assert len(a) == len(b) == 300 // LONG_RUN_WINDOW
        return sum(abs(x - y) for x, y in zip(a, b)) / len(a)

    one, two, other_seed = train(3, [64]), train(3, [32, 32]), train(4, [64])
    assert distance(one, two) < distance(one, other_seed), (distance(one, two), distance(one, other_seed))

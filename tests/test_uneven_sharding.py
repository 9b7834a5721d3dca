"""--ddp-backend fully_sharded --shard-fractions: each rank its own share of the state, the same update.

Real gloo process groups; the references are plain PyTorch loops over the same global batches
(tests/toy_reference.py), a one-process hetfair run for BERT, and replicated DDP for fp16's overflows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import TOY_PLUGIN, final_parameters, free_port, node_commands, rank_flags, run_nodes
from hetfair.parallel.uneven_shards import shard_bounds
from test_fully_sharded import adam_args
from toy_reference import assert_same, reference_parameters, toy_train_args


def run_uneven(tmp_path: Path, save_dir: Path, batch_sizes: list[int], fractions: str, extra: tuple[str, ...] = (),
               update_freq: int = 1) -> list[str]:
    """Train the toy model with one command per rank; each rank's stderr."""
    init = f"tcp://127.0.0.1:{free_port()}"
    sharding = ("--ddp-backend", "fully_sharded", "--shard-fractions", fractions) if len(batch_sizes) > 1 else ()
    commands = node_commands(toy_train_args(save_dir, update_freq, extra), batch_sizes, init, *sharding)
    results = run_nodes(commands, cwd=tmp_path)
    for result in results:
        assert result.returncode == 0, result.stderr
    return [result.stderr for result in results]


def test_every_element_goes_to_exactly_one_rank_in_proportion():
    assert shard_bounds(10, (0.25, 0.75)) == [0, 2, 10]  # round(2.5) is 2
    assert shard_bounds(1, (0.25, 0.25, 0.5)) == [0, 0, 1, 1]  # a rank may hold nothing of a small parameter
    assert shard_bounds(1000, (0.25, 0.25, 0.5)) == [0, 250, 500, 1000]


@pytest.mark.parametrize("batch_sizes, fractions, reshard", [([8, 24], "1,3", True), ([2, 6, 24], "1,1,2", False)],
                         ids=["1:3", "1:1:2-no-reshard"])
def test_uneven_fractions_give_the_plain_update(tmp_path, batch_sizes, fractions, reshard):
    clip = 0.05  # most updates are clipped: the norm must be the global one over all shards
    expected = reference_parameters(update_size=32 * 2, clip_norm=clip)
    extra = ("--clip-norm", str(clip), "--toy-hidden", "16", "--log-format", "json") + (
        () if reshard else ("--no-reshard-after-forward",))
    stderr = run_uneven(tmp_path, tmp_path / "ckpt", batch_sizes, fractions, extra, update_freq=2)
    assert_same(final_parameters(tmp_path / "ckpt"), expected)
    report = shard_record(stderr[0])
    held = [report[f"state_bytes{rank}"] for rank in range(len(batch_sizes))]
    for rank, size in enumerate(held):  # parameters, gradients, SGD has no state: the fraction of the whole
        assert size <= 1.1 * report[f"fraction{rank}"] * sum(held), (rank, held)


def shard_record(stderr: str) -> dict[str, float]:
    records = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    (record,) = [r for r in records if r["phase"] == "zero"]
    return record


def test_uneven_fp16_skips_the_same_overflowing_updates_as_replicated_ranks(tmp_path):
    """Each rank sees only its gradient shards; the ranks must agree on every overflow, as DDP ranks do."""
    fp16 = ("--fp16", "--fp16-init-scale", str(2**18), "--fp16-scale-window", "3", "--max-update", "12",
            "--max-epoch", "0")
    run_uneven(tmp_path, tmp_path / "sharded", [8, 24], "1,3", fp16)
    init = f"tcp://127.0.0.1:{free_port()}"
    for result in run_nodes(node_commands(toy_train_args(tmp_path / "ddp", 1, fp16), [8, 24], init), cwd=tmp_path):
        assert result.returncode == 0, result.stderr
    assert_same(final_parameters(tmp_path / "sharded"), final_parameters(tmp_path / "ddp"))
    scales = [torch.load(tmp_path / run / "checkpoint_last.pt", weights_only=True)["loss_scale"]
              for run in ("sharded", "ddp")]
    assert scales[0] == scales[1] and scales[0]["scale"] < 2**18  # the same overflows were skipped


def test_checkpoints_move_between_unsharded_uneven_and_even_runs(tmp_path):
    """unsharded -> 1:3 -> 1:1 -> unsharded (Adam: its state is sliced and gathered) ends where one run ends."""
    straight = tmp_path / "straight"
    run_uneven(tmp_path, straight, [32], "", adam_args(straight, 8))
    chain = tmp_path / "chain"
    for batch_sizes, fractions, stop in (([32], "", 2), ([8, 24], "1,3", 4), ([16, 16], "1,1", 6), ([32], "", 8)):
        run_uneven(tmp_path, chain, batch_sizes, fractions, adam_args(chain, stop))
    assert_same(final_parameters(chain), final_parameters(straight))


def test_bert_uneven_per_encoder_layer_matches_one_process(tmp_path):
    from bert_helpers import make_data_dir, write_bert_config

    data_dir, _, _ = make_data_dir(tmp_path, n_docs=60, splits=("train", "valid"))
    config = write_bert_config(tmp_path / "c.json", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    common = ["--task", "bert", "--data", str(data_dir), "--config_file", str(config), "--nsp", "--optimizer", "adam",
              "--lr", "0.001", "--lr-scheduler", "fixed", "--max-update", "3", "--update-freq", "2",
              "--clip-norm", "0.5", "--no-epoch-checkpoints", "--log-format", "none", "--distributed-timeout", "120",
              "--validate-interval-updates", "2", "--max-sentences-valid", "5"]  # validation: uneven shares
    init = f"tcp://127.0.0.1:{free_port()}"
    single = run_nodes([common + ["--max-sentences", "12", "--save-dir", str(tmp_path / "one")]], cwd=tmp_path)
    sharded = run_nodes([common + ["--max-sentences", str(batch), "--save-dir", str(tmp_path / "two"),
                                   *rank_flags(rank, 2, init), "--ddp-backend", "fully_sharded",
                                   "--shard-fractions", "1,3"]
                         for rank, batch in enumerate([4, 8])], cwd=tmp_path, timeout=300)
    for result in single + sharded:
        assert result.returncode == 0, result.stderr
    expected, actual = final_parameters(tmp_path / "one"), final_parameters(tmp_path / "two")
    assert expected.keys() == actual.keys()
    for name in expected:  # the fully_sharded BERT test's tolerance: Adam divides by small second moments
        torch.testing.assert_close(actual[name], expected[name], atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("flags, message", [
    (["--shard-fractions", "1,2,3"], "--shard-fractions has 3 values but the job has 2 processes"),
    (["--shard-fractions", "1,-3"], "give one positive number per rank"),
    (["--shard-fractions", "1,3", "--ddp-backend", "c10d"], "--shard-fractions needs --ddp-backend fully_sharded"),
    (["--shard-fractions", "1,3", "--ddp-backend", "hybrid_sharded"], "hybrid_sharded shards evenly"),
    (["--offload", "1", "--ddp-backend", "c10d"], "--offload needs --ddp-backend fully_sharded"),
    (["--offload", "2", "--shard-fractions", "1,3"], "--offload must be at most 1"),
])
def test_flags_that_cannot_work_are_one_line(tmp_path, flags, message):
    command = toy_train_args(tmp_path / "ckpt", 1, ("--ddp-backend", "fully_sharded", *flags))
    [result] = run_nodes([command + ["--distributed-world-size", "2", "--max-sentences", "8"]], cwd=tmp_path)
    err = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(err) == 1 and message in err[0], err


def test_offload_on_a_cpu_device_is_one_line(tmp_path):
    init = f"tcp://127.0.0.1:{free_port()}"
    commands = [toy_train_args(tmp_path / "ckpt", 1, ("--ddp-backend", "fully_sharded", "--shard-fractions", "1,3",
                                                      "--offload", offload)) + rank_flags(rank, 2, init)
                for rank, offload in enumerate(["1", "0"])]
    results = run_nodes(commands, cwd=tmp_path, timeout=120)
    err = results[0].stderr.strip().splitlines()
    assert results[0].returncode == 2 and len(err) == 1, err
    assert "--offload 1 keeps rank 0's shards in host memory for a CUDA device" in err[0], err
    assert results[1].returncode != 0  # its peer left: it stops too, and does not hang

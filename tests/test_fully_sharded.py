"""--ddp-backend fully_sharded (FSDP2): the same update as everywhere else, portable checkpoints, clear errors.

Real gloo process groups; the reference is a plain PyTorch loop over the same global batches.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import TOY_PLUGIN, final_parameters, free_port, node_commands, rank_flags, run_nodes
from hetfair_cli.train import main as train_main
from hetfair_cli.validate import main as validate_main
from toy_reference import assert_same, reference_parameters, toy_train_args


def run_cluster(tmp_path: Path, save_dir: Path, batch_sizes: list[int], extra: tuple[str, ...],
                update_freq: int = 1) -> dict[str, torch.Tensor]:
    init = f"tcp://127.0.0.1:{free_port()}"
    commands = node_commands(toy_train_args(save_dir, update_freq, extra), batch_sizes, init,
                             "--ddp-backend", "fully_sharded")
    for result in run_nodes(commands, cwd=tmp_path):
        assert result.returncode == 0, result.stderr
    return final_parameters(save_dir)


@pytest.mark.parametrize("batch_sizes, reshard", [([8, 24], True), ([2, 6, 24], True), ([2, 6, 24], False)],
                         ids=["2-ranks", "3-ranks", "3-ranks-no-reshard"])
def test_fully_sharded_update_is_the_plain_update(tmp_path, batch_sizes, reshard):
    clip = 0.05  # most updates are clipped: the norm must be the global one over all shards
    expected = reference_parameters(update_size=32 * 2, clip_norm=clip)
    extra = ("--clip-norm", str(clip), "--toy-hidden", "16") + (() if reshard else ("--no-reshard-after-forward",))
    actual = run_cluster(tmp_path, tmp_path / "ckpt", batch_sizes, extra, update_freq=2)
    assert_same(actual, expected)


def adam_args(save_dir: Path, max_update: int) -> tuple[str, ...]:
    return ("--optimizer", "adam", "--lr", "0.01", "--max-update", str(max_update), "--max-epoch", "0")


def test_checkpoints_move_between_unsharded_and_sharded_runs_of_any_size(tmp_path):
    """1 unsharded -> 3 sharded -> 2 sharded -> 1 unsharded ends where one uninterrupted run ends."""
    straight = run_cluster(tmp_path, tmp_path / "straight", [32], adam_args(tmp_path, 16))
    chain = tmp_path / "chain"
    for batch_sizes, stop in (([32], 4), ([2, 6, 24], 8), ([8, 24], 12), ([32], 16)):
        run_cluster(tmp_path, chain, batch_sizes, adam_args(tmp_path, stop))
    assert_same(final_parameters(chain), straight)
    assert validate_main(["--path", str(chain / "checkpoint_last.pt"), "--user-dir", str(TOY_PLUGIN)]) == 0


@pytest.mark.parametrize("flags, message", [
    (["--ddp-backend", "fully_sharded"], "needs more than one process"),
    (["--ddp-backend", "fully_sharded", "--zero-sharding", "os"],
     "--zero-sharding needs --ddp-backend c10d (this command has --ddp-backend fully_sharded)"),
    (["--no-reshard-after-forward"], "needs --ddp-backend fully_sharded"),
])
def test_combinations_that_cannot_work_are_one_line(tmp_path, capsys, flags, message):
    code = train_main(["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--max-update", "1", "--log-format", "none",
                       "--save-dir", str(tmp_path), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err


def test_bert_sharded_per_encoder_layer_matches_one_process(tmp_path):
    from bert_helpers import make_data_dir, write_bert_config

    data_dir, _, _ = make_data_dir(tmp_path, n_docs=60, splits=("train", "valid"))
    config = write_bert_config(tmp_path / "c.json", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    common = ["--task", "bert", "--data", str(data_dir), "--config_file", str(config), "--nsp", "--optimizer", "adam",
              "--lr", "0.001", "--lr-scheduler", "fixed", "--max-update", "3", "--update-freq", "2",
              "--no-epoch-checkpoints", "--log-format", "none", "--distributed-timeout", "120",
              "--validate-interval-updates", "2", "--max-sentences-valid", "5"]  # validation: uneven shares
    init = f"tcp://127.0.0.1:{free_port()}"
    single = run_nodes([common + ["--max-sentences", "12", "--save-dir", str(tmp_path / "one")]], cwd=tmp_path)
    sharded = run_nodes([common + ["--max-sentences", str(batch), "--save-dir", str(tmp_path / "two"),
                                   *rank_flags(rank, 2, init), "--ddp-backend", "fully_sharded"]
                         for rank, batch in enumerate([4, 8])], cwd=tmp_path, timeout=300)
    for result in single + sharded:
        assert result.returncode == 0, result.stderr
    expected, actual = final_parameters(tmp_path / "one"), final_parameters(tmp_path / "two")
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], atol=2e-5, rtol=1e-4, msg=name)


def test_ranks_with_different_ddp_backends_fail_together(tmp_path):
    init = f"tcp://127.0.0.1:{free_port()}"
    commands = [toy_train_args(tmp_path / "ckpt", 1, backend) + rank_flags(rank, 2, init)
                for rank, backend in enumerate([("--ddp-backend", "fully_sharded"), ()])]
    for result in run_nodes(commands, cwd=tmp_path, timeout=120):
        assert result.returncode == 2 and "(or another --ddp-backend)" in result.stderr, result.stderr


def test_fully_sharded_fp16_skips_the_same_overflowing_updates_as_replicated_ranks(tmp_path):
    """Each rank sees only its gradient shards; the ranks must still agree on every overflow, as DDP ranks do."""
    fp16 = ("--fp16", "--fp16-init-scale", str(2**18), "--fp16-scale-window", "3", "--max-update", "12",
            "--max-epoch", "0")
    sharded = run_cluster(tmp_path, tmp_path / "sharded", [8, 24], fp16)
    init = f"tcp://127.0.0.1:{free_port()}"
    commands = node_commands(toy_train_args(tmp_path / "ddp", 1, fp16), [8, 24], init)
    for result in run_nodes(commands, cwd=tmp_path):
        assert result.returncode == 0, result.stderr
    assert_same(sharded, final_parameters(tmp_path / "ddp"))
    scales = [torch.load(tmp_path / run / "checkpoint_last.pt", weights_only=True)["loss_scale"]
              for run in ("sharded", "ddp")]
    assert scales[0] == scales[1] and scales[0]["scale"] < 2**18  # the same overflows were skipped

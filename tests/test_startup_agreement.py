"""The one start-up exchange: every rank's precision and batch sizes, and one error for every disagreement."""

from __future__ import annotations

import pytest

from helpers import free_port, rank_flags, run_nodes
from hetfair.errors import ConfigError
from hetfair.run.startup import LOSS_SCALE, PARALLELISM, RankFacts, check_agreement
from toy_reference import toy_train_args

SHARDING = {"--ddp-backend": "c10d", "--zero-sharding": "none", "--zero-shard-weights": None}
SCALING = {"--fp16-init-scale": 128.0, "--fp16-scale-window": 2000, "--min-loss-scale": 1e-4,
           "--threshold-loss-scale": None}


def rank(precision: str = "fp32", capacity: int = 8, sharding: dict | None = None,
         scaling: dict | None = None) -> RankFacts:
    """One rank's facts: the default settings, with ``sharding`` and ``scaling`` flags replaced."""
    return RankFacts(precision, capacity, capacity * 2,
                     {PARALLELISM: {**SHARDING, **(sharding or {})}, LOSS_SCALE: {**SCALING, **(scaling or {})}})


def test_every_rank_learns_every_ranks_precision_and_batch_sizes():
    job = check_agreement([rank("fp32", 8), rank("bf16", 24), rank("fp16", 4)])
    assert (job.precisions, job.train_caps, job.valid_caps) == (["fp32", "bf16", "fp16"], [8, 24, 4], [16, 48, 8])


def test_loss_scaling_flags_may_differ_when_no_rank_runs_fp16():
    check_agreement([rank("fp32"), rank("bf16", scaling={"--fp16-init-scale": 64.0})])


def test_one_error_names_every_disagreeing_rank_and_setting():
    ranks = [rank("fp16"), rank(sharding={"--zero-sharding": "os"}), rank(sharding={"--ddp-backend": "fully_sharded"}),
             rank(scaling={"--fp16-init-scale": 64.0})]
    with pytest.raises(ConfigError) as info:
        check_agreement(ranks)
    assert str(info.value) == (
        "ranks [1, 2] were given other --zero-sharding/--zero-shard-weights than rank 0 (or another --ddp-backend): "
        "--ddp-backend c10d on ranks 0, 1, 3, fully_sharded on rank 2, --zero-sharding none on ranks 0, 2, 3, "
        "os on rank 1; ranks [3] were given other --fp16-init-scale/--fp16-scale-window/--min-loss-scale/"
        "--threshold-loss-scale (or --update-freq) than rank 0, and the job shares one loss scale: "
        "--fp16-init-scale 128.0 on ranks 0, 1, 2, 64.0 on rank 3; give every node's command the same values")


def test_nodes_given_other_settings_stop_together_with_the_same_line(tmp_path):
    init = f"tcp://127.0.0.1:{free_port()}"
    per_node = [("--fp16", "--zero-sharding", "os"), ("--fp16", "--fp16-init-scale", "64")]
    commands = [[*toy_train_args(tmp_path / "ckpt", 1, extra), *rank_flags(r, 2, init)]
                for r, extra in enumerate(per_node)]
    for result in run_nodes(commands, cwd=tmp_path, timeout=120):
        assert result.returncode == 2, result.stderr
        line, = result.stderr.strip().splitlines()
        assert "--zero-sharding os on rank 0, none on rank 1" in line
        assert "--fp16-init-scale 128.0 on rank 0, 64.0 on rank 1" in line

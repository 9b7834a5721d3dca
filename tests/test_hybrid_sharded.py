"""--ddp-backend hybrid_sharded and --reduce-dtype bf16: sharded training for slow links between nodes.

Real gloo process groups, on one machine and across network namespaces (netns.py); the
reference is the plain PyTorch loop of toy_reference.py over the same global batches.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import TOY_PLUGIN, final_parameters, free_port, node_commands, rank_flags, run_nodes
from hetfair.errors import ConfigError
from hetfair.parallel import ParallelConfig
from hetfair.parallel.nodes import node_layout
from hetfair.run.startup import PARALLELISM, RankFacts, check_agreement
from hetfair_cli.train import main as train_main
from multi_host import finish, node_env, start_on
from toy_reference import assert_same, reference_parameters, toy_train_args

HYBRID_2X2 = ("--ddp-backend", "hybrid_sharded", "--shard-group-size", "2")
"""Four ranks on this machine as two "nodes" of two: ranks 0, 1 shard together, and ranks 2, 3."""

BF16_RELATIVE_TOLERANCE = 1e-2
"""How far (relative 2-norm of all parameters) a bf16-reduced run may end from the fp32 one.

Each gradient element is rounded to bf16 (8 significant bits, relative error <= 2**-9) once when
cast and once per addition of the two collectives (reduce-scatter over 2 ranks, all-reduce over 2
nodes): <= 3 * 2**-9 ~ 0.6% of each update. The toy's 14 SGD updates move the parameters by less than
their initial norm, and its loss is smooth, so the drift stays below 0.6% of the parameters; 1% leaves
room for the reorderings without letting an fp32 reduction (drift 0) or a wrong one (drift >> 1%) pass.
"""


def run_cluster(tmp_path: Path, save_dir: Path, batch_sizes: list[int], extra: tuple[str, ...],
                per_node: tuple[str, ...] = HYBRID_2X2, update_freq: int = 1) -> dict[str, torch.Tensor]:
    init = f"tcp://127.0.0.1:{free_port()}"
    commands = node_commands(toy_train_args(save_dir, update_freq, extra), batch_sizes, init, *per_node)
    for result in run_nodes(commands, cwd=tmp_path):
        assert result.returncode == 0, result.stderr
    return final_parameters(save_dir)


def test_hybrid_update_is_the_plain_update_with_uneven_batches(tmp_path):
    clip = 0.05  # most updates are clipped: the norm is over the shards of one node, not all four
    extra = ("--clip-norm", str(clip), "--toy-hidden", "16")
    actual = run_cluster(tmp_path, tmp_path / "ckpt", [2, 6, 8, 16], extra, update_freq=2)
    assert_same(actual, reference_parameters(update_size=32 * 2, clip_norm=clip))


def start_on_hosts(network, tmp_path: Path, hosts: list[int], batches: list[int], *extra: str) -> list[tuple[int, str]]:
    """Rank ``r`` of a hybrid toy job on host ``hosts[r]`` with batch ``batches[r]``: each command's exit code and
    stderr (the log goes there)."""
    init = f"tcp://{network.hosts[0].address}:29500"
    env = node_env()
    procs = []
    for rank, (host, batch) in enumerate(zip(hosts, batches)):
        args = toy_train_args(tmp_path / "ckpt", 1) + ["--max-sentences", str(batch),
                                                       *rank_flags(rank, len(hosts), init),
                                                       "--ddp-backend", "hybrid_sharded", *extra]
        procs.append(start_on(network, host, args, tmp_path, env))
    return finish(procs)


def test_two_hosts_of_two_processes_shard_inside_each_host(make_network, tmp_path):
    """No --shard-group-size: the ranks find their hosts, even where each host's ranks are not consecutive
    (host 0 runs ranks 0 and 2), and replicate across the two hosts' link."""
    results = start_on_hosts(make_network(2), tmp_path, [0, 1, 0, 1], [4, 12, 6, 10], "--log-format", "json")
    for code, err in results:
        assert code == 0, err
    records = [json.loads(line) for line in results[0][1].splitlines() if line.startswith("{")]
    [mesh] = [record for record in records if record["phase"] == "zero"]
    assert (mesh["nodes"], mesh["ranks_per_node"]) == (2, 2)
    assert_same(final_parameters(tmp_path / "ckpt"), reference_parameters(update_size=32))


def test_hosts_with_unequal_numbers_of_processes_are_one_line(make_network, tmp_path):
    for code, err in start_on_hosts(make_network(2), tmp_path, [0, 0, 1], [8, 8, 16]):
        [line] = err.splitlines()
        assert code == 2 and "needs the same number of processes on every node, but the job has ranks 0, 1 on " \
                             "one node; ranks 2 on one node" in line, err


def adam_args(max_update: int) -> tuple[str, ...]:
    return ("--optimizer", "adam", "--lr", "0.01", "--max-update", str(max_update), "--max-epoch", "0")


def test_checkpoints_move_between_hybrid_and_replicated_runs_of_any_size(tmp_path):
    """2x2 hybrid -> 1 unsharded -> 2x1 hybrid ends where one uninterrupted Adam run ends."""
    straight = run_cluster(tmp_path, tmp_path / "straight", [32], adam_args(12))
    chain = tmp_path / "chain"
    run_cluster(tmp_path, chain, [2, 6, 8, 16], adam_args(4))
    run_cluster(tmp_path, chain, [32], adam_args(8))
    run_cluster(tmp_path, chain, [8, 24], adam_args(12), per_node=("--ddp-backend", "hybrid_sharded",
                                                                   "--shard-group-size", "1"))
    assert_same(final_parameters(chain), straight)


def test_bf16_reduction_tracks_fp32_and_resumes_exactly(tmp_path):
    bf16 = ("--reduce-dtype", "bf16")
    straight = run_cluster(tmp_path, tmp_path / "straight", [2, 6, 8, 16], bf16 + ("--save-interval-updates", "4"))
    expected = reference_parameters(update_size=32)
    drift = (torch.linalg.vector_norm(torch.cat([(straight[name] - expected[name]).flatten() for name in expected]))
             / torch.linalg.vector_norm(torch.cat([expected[name].flatten() for name in expected])))
    assert 0 < drift < BF16_RELATIVE_TOLERANCE, drift  # not 0: the gradients did travel in bf16
    midway = tmp_path / "straight" / "checkpoint_1_4.pt"  # inside the first epoch
    resumed = run_cluster(tmp_path, tmp_path / "resumed", [2, 6, 8, 16], bf16 + ("--restore-file", str(midway)))
    assert_same(resumed, straight)


def test_ranks_given_different_reduce_dtypes_or_shard_groups_disagree():
    ranks = [RankFacts("fp32", 8, 8, {PARALLELISM: ParallelConfig("hybrid_sharded", **flags).shared_settings()})
             for flags in ({"reduce_dtype": "bf16", "shard_group_size": 2}, {})]
    with pytest.raises(ConfigError, match="--reduce-dtype bf16 on rank 0, fp32 on rank 1, --shard-group-size 2 on "
                                          "rank 0, None on rank 1"):
        check_agreement(ranks)


@pytest.mark.parametrize("flags, message", [
    (["--reduce-dtype", "bf16"], "--reduce-dtype needs --ddp-backend fully_sharded or hybrid_sharded"),
    (["--shard-group-size", "2"], "--shard-group-size needs --ddp-backend hybrid_sharded"),
    (["--ddp-backend", "fully_sharded", "--shard-group-size", "2"], "--shard-group-size needs --ddp-backend hybrid"),
    (["--ddp-backend", "hybrid_sharded"], "hybrid_sharded needs more than one process"),
    (["--ddp-backend", "hybrid_sharded", "--zero-sharding", "os"],
     "--zero-sharding needs --ddp-backend c10d (this command has --ddp-backend hybrid_sharded)"),
    (["--ddp-backend", "hybrid_sharded", "--distributed-world-size", "4", "--shard-group-size", "3"],
     "--shard-group-size 3 does not divide the 4 processes"),
])
def test_combinations_that_cannot_work_are_one_line(tmp_path, capsys, flags, message):
    code = train_main(["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--max-update", "1", "--log-format", "none",
                       "--save-dir", str(tmp_path), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err


def test_nodes_are_the_ranks_of_one_machine_in_rank_order():
    assert node_layout(["b", "a", "b", "a"]) == [[0, 2], [1, 3]]
    assert node_layout(["a"] * 4) == [[0, 1, 2, 3]]


def test_nodes_of_unequal_sizes_are_one_line():
    with pytest.raises(ConfigError, match="same number of processes on every node, but the job has ranks 0, 1 on "
                                          "one node; ranks 2 on one node; .* --shard-group-size N"):
        node_layout(["a", "a", "b"])

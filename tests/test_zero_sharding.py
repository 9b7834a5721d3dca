"""Optimizer-state sharding (--zero-sharding os) changes where the state lives, not the result.

Real gloo groups throughout: the optimizer itself in process groups started by
hetfair's own worker launcher, training and checkpoints with one hetfair-train command
per rank. Everything is compared with plain, unsharded ``torch.optim.Adam``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from helpers import final_parameters, free_port, rank_flags, run_nodes
from hetfair.checkpoint.layout import load_checkpoint
from hetfair.parallel.context import DistributedContext
from hetfair.parallel.zero_sharding import full_state_dict, optimizer_state_bytes, parse_shard_weights
from hetfair.parallel.zero_optimizer import ShardedOptimizer, weighted_partition
from hetfair.errors import ConfigError
from hetfair_cli.train import main as train_main
from hetfair.launch.supervisor import run_workers
from toy_plugin import Blobs, ToyMLP
from toy_reference import EPOCHS, SEED, TRAIN_SIZE, assert_same, toy_train_args

ADAM = ("--optimizer", "adam", "--lr", "0.05")


# -- plain PyTorch reference -------------------------------------------------------
def adam_reference(update_size: int, max_updates: Optional[int] = None, clip_norm: float = 0.0,
                   warmup: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Adam on mean cross-entropy over consecutive chunks of each epoch's order (linear warm-up)."""
    torch.manual_seed(SEED)
    model = ToyMLP(hidden=16)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    data = Blobs(TRAIN_SIZE, seed=0)
    updates = 0
    for epoch in range(1, EPOCHS + 1):
        order = np.random.default_rng([SEED, epoch]).permutation(TRAIN_SIZE)
        for start in range(0, TRAIN_SIZE, update_size):
            if updates == max_updates:
                return model.state_dict(), optimizer.state_dict()
            optimizer.param_groups[0]["lr"] = 0.05 * min(1.0, (updates + 1) / warmup) if warmup else 0.05
            indices = torch.as_tensor(order[start : start + update_size])
            optimizer.zero_grad()
            F.cross_entropy(model(data.inputs[indices]), data.labels[indices]).backward()
            if clip_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
            optimizer.step()
            updates += 1
    return model.state_dict(), optimizer.state_dict()


def _settings(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The param groups without how torch computes the step (hetfair's ``--optimizer-impl`` picks fused)."""
    return [{k: v for k, v in group.items() if k not in ("foreach", "fused")} for group in groups]


def assert_same_optimizer_state(actual: dict[str, Any], expected: dict[str, Any], atol: float = 1e-6) -> None:
    assert _settings(actual["param_groups"]) == _settings(expected["param_groups"])
    assert actual["state"].keys() == expected["state"].keys()
    for index, state in expected["state"].items():
        assert actual["state"][index].keys() == state.keys()
        for name, value in state.items():
            torch.testing.assert_close(actual["state"][index][name], value, rtol=1e-4, atol=atol, msg=name)


# -- the optimizer in real gloo groups --------------------------------------------
def _layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(32, 32) for _ in range(24)])  # 48 parameters of equal kind


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    generator = torch.Generator().manual_seed(step)  # the same full gradients on every rank, as after DDP
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator)
    optimizer.step()


def _shard_worker(rank: int, world: int, init_file: str, weights: Optional[list[float]], out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        context = DistributedContext(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
        model, reference = _layers(), _layers()
        sharded = ShardedOptimizer(list(model.parameters()), torch.optim.Adam, weights, lr=0.01)
        plain = torch.optim.Adam(reference.parameters(), lr=0.01)
        for step in range(3):
            _step(model, sharded, step)
            _step(reference, plain, step)
        result = {"params": model.state_dict(), "reference": copy.deepcopy(reference.state_dict()),
                  "local_bytes": optimizer_state_bytes(sharded), "full_bytes": optimizer_state_bytes(plain),
                  "shard_numels": sharded.shard_numels(), "saved": full_state_dict(sharded, context),
                  "equal_weight_numels": [sum(p.numel() for p in shard)
                                          for shard in weighted_partition(list(model.parameters()), [1.0] * world)],
                  "plain_saved": copy.deepcopy(plain.state_dict())}

        # an unsharded state loads into a sharded optimizer (any world size) and training continues
        resumed_model = copy.deepcopy(reference)
        resumed = ShardedOptimizer(list(resumed_model.parameters()), torch.optim.Adam, weights, lr=0.01)
        resumed.load_state_dict(copy.deepcopy(plain.state_dict()))  # as from a file: no shared tensors
        result.update(loaded_bytes=optimizer_state_bytes(resumed), stray_state=len(resumed.state))
        _step(resumed_model, resumed, 3)
        _step(reference, plain, 3)
        result.update(resumed_params=resumed_model.state_dict(), resumed_reference=reference.state_dict(),
                      resaved=full_state_dict(resumed, context), plain_resaved=plain.state_dict())
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_shard_workers(tmp_path: Path, world: int, weights: Optional[list[float]]) -> list[dict[str, Any]]:
    run_workers(world, 0, _shard_worker, (world, str(tmp_path / "rendezvous"), weights, str(tmp_path)))
    return [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(world)]


@pytest.mark.parametrize("world,weights", [(2, None), (3, [1.0, 2.0, 1.0])])
def test_each_rank_holds_its_share_of_the_state_and_updates_match_plain_adam(tmp_path, world, weights):
    results = run_shard_workers(tmp_path, world, weights)
    shares = [w / sum(weights) for w in weights] if weights else [1 / world] * world
    full_bytes = results[0]["full_bytes"]
    assert sum(r["local_bytes"] for r in results) == full_bytes  # every state tensor lives on exactly one rank
    numels = results[0]["shard_numels"]
    for rank, result in enumerate(results):
        assert result["shard_numels"] == numels  # every rank sees the same partition
        if weights is None:  # equal weights reproduce torch's own balanced partition
            assert result["equal_weight_numels"] == numels
        assert result["local_bytes"] == pytest.approx(shares[rank] * full_bytes, rel=0.05)
        assert numels[rank] == pytest.approx(shares[rank] * sum(numels), rel=0.05)
        assert_same(result["params"], result["reference"])

    saved = results[0]["saved"]
    assert all(r["saved"] is None for r in results[1:])
    assert_same_optimizer_state(saved, results[0]["plain_saved"])  # consolidated = plain format and values
    plain = torch.optim.Adam(_layers().parameters(), lr=0.01)
    plain.load_state_dict(saved)  # a sharded save resumes unsharded

    for rank, result in enumerate(results):
        assert result["stray_state"] == 0 and result["loaded_bytes"] == result["local_bytes"]
        assert_same(result["resumed_params"], result["resumed_reference"])
    assert_same_optimizer_state(results[0]["resaved"], results[0]["plain_resaved"])


# -- training with hetfair-train, one command per rank --------------------------------
def launch(save_dir: Path, batch_sizes: list[int], *extra: str, update_freq: int = 1) -> list[str]:
    """Train with one command per rank (each its own --max-sentences); return each rank's stderr."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    commands = []
    for rank, batch in enumerate(batch_sizes):
        commands.append(toy_train_args(save_dir, update_freq, (*ADAM, *extra)) + [
            "--max-sentences", str(batch), *rank_flags(rank, len(batch_sizes), init_method)])
    results = run_nodes(commands, cwd=save_dir.parent)
    for result in results:
        assert result.returncode == 0, result.stderr
    return [result.stderr for result in results]


def zero_log(stderr: str) -> dict[str, float]:
    records = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    (record,) = [r for r in records if r["phase"] == "zero"]
    return record


def test_sharded_training_matches_plain_adam(tmp_path):
    """Heterogeneous batches, --update-freq 2, clipping, warm-up and weighted shards."""
    clip, warmup = 0.3, 3
    stderr = launch(tmp_path / "ckpt", [8, 24], "--clip-norm", str(clip), "--warmup-updates", str(warmup),
                    "--zero-sharding", "os", "--zero-shard-weights", "1,3", "--log-format", "json",
                    update_freq=2)
    expected, _ = adam_reference(update_size=64, clip_norm=clip, warmup=warmup)
    assert_same(final_parameters(tmp_path / "ckpt"), expected)

    log = zero_log(stderr[0])
    params = list(ToyMLP(hidden=16).parameters())
    plain_state_bytes = sum(8 * p.numel() + 4 for p in params)  # Adam: exp_avg, exp_avg_sq, float32 step
    assert log["state_bytes0"] + log["state_bytes1"] == plain_state_bytes
    assert [log["params0"], log["params1"]] == [sum(p.numel() for p in shard)
                                                for shard in weighted_partition(params, [1, 3])]
    assert log["params1"] > 2 * log["params0"]


def test_checkpoints_move_between_sharded_unsharded_and_world_sizes(tmp_path):
    save_dir = tmp_path / "ckpt"  # 7 updates of 32 samples per epoch; stops at 3, 6, 9 are mid-epoch
    single_process = (*ADAM, "--max-sentences", "32")
    assert train_main(toy_train_args(save_dir, 1, (*single_process, "--max-update", "3"))) == 0
    launch(save_dir, [8, 24], "--zero-sharding", "os", "--max-update", "6")  # unsharded -> sharded
    saved = load_checkpoint(save_dir / "checkpoint_last.pt")["trainer"]["optimizer"]
    assert_same_optimizer_state(saved, adam_reference(update_size=32, max_updates=6)[1], atol=1e-5)

    launch(save_dir, [4, 12, 16], "--zero-sharding", "os", "--max-update", "9")  # 2 -> 3 ranks, sharded
    assert train_main(toy_train_args(save_dir, 1, single_process)) == 0  # sharded -> unsharded, to the end

    assert load_checkpoint(save_dir / "checkpoint_last.pt")["trainer"]["num_updates"] == 14
    assert_same(final_parameters(save_dir), adam_reference(update_size=32)[0])


# -- user errors -------------------------------------------------------------------
@pytest.mark.parametrize("text,message", [
    ("1,2,3", "has 3 weights but there are 2 ranks"),
    ("1,0", "must all be positive"),
    ("1,-2", "must all be positive"),
    ("1,fast", "must be numbers"),
])
def test_bad_shard_weights_are_one_line_errors(text, message):
    with pytest.raises(ConfigError, match=message) as info:
        parse_shard_weights(text, world_size=2)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("extra,message", [
    (("--zero-sharding", "os"), "--zero-sharding os needs more than one process (--distributed-world-size N)"),
    (("--zero-shard-weights", "1,2"), "--zero-shard-weights needs --zero-sharding os (this command has --zero-sharding "
                                      "none)"),
])
def test_sharding_misconfiguration_is_reported(tmp_path, capsys, extra, message):
    assert train_main(toy_train_args(tmp_path, 1, (*ADAM, *extra))) == 2
    assert capsys.readouterr().err.strip() == f"hetfair-train: error: {message}"


def test_ranks_with_different_sharding_flags_fail_together(tmp_path):
    init_method = f"tcp://127.0.0.1:{free_port()}"
    commands = [toy_train_args(tmp_path / "ckpt", 1, (*ADAM, *sharding)) + rank_flags(rank, 2, init_method)
                for rank, sharding in enumerate([("--zero-sharding", "os"), ()])]
    for result in run_nodes(commands, cwd=tmp_path, timeout=120):
        assert result.returncode != 0
        assert "ranks [1] were given other --zero-sharding/--zero-shard-weights than rank 0" in result.stderr

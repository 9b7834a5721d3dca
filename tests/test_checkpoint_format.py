"""The checkpoint layout: its documented top-level keys, composition from parts, format migration."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import TOY_PLUGIN, final_parameters
from hetfair.checkpoint import layout as checkpoint_layout
from hetfair.checkpoint.layout import FORMAT_VERSION, CheckpointConfig, Checkpointer, atomic_save, load_checkpoint
from hetfair.errors import CheckpointError
from hetfair_cli.train import main as train_main

DOCUMENTED_KEYS = {"format_version", "best_metric", "config", "trainer", "position", "clock", "epoch_stats", "batch",
                   "plan", "rng"}
OPTIONAL_KEYS = {"balance", "loss_scale", "comm"}  # --auto-balance, a rank in fp16, PowerSGD (test_comm_hooks.py)


def toy_args(save_dir: Path, *extra: str) -> list[str]:
    return ["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--save-dir", str(save_dir), "--optimizer", "sgd",
            "--momentum", "0.9", "--lr", "0.2", "--max-sentences", "16", *extra]


def test_checkpoint_holds_the_documented_top_level_keys(tmp_path):
    assert train_main(toy_args(tmp_path / "plain", "--max-update", "3", "--log-format", "none")) == 0
    state = load_checkpoint(tmp_path / "plain" / "checkpoint_last.pt")
    assert set(state) == DOCUMENTED_KEYS and state["format_version"] == FORMAT_VERSION
    assert set(state["trainer"]) == {"model", "optimizer", "optimizer_name", "lr_scheduler", "num_updates"}
    assert set(state["plan"]) == {"world_size", "backend", "fractions", "micro_batches", "ranks"}
    assert (state["plan"]["world_size"], state["plan"]["micro_batches"]) == (1, [16])

    assert train_main(toy_args(tmp_path / "balanced", "--max-update", "3", "--log-format", "none",
                               "--auto-balance")) == 0
    balanced = load_checkpoint(tmp_path / "balanced" / "checkpoint_last.pt")
    assert set(balanced) == DOCUMENTED_KEYS | {"balance"}

    assert train_main(toy_args(tmp_path / "fp16", "--max-update", "3", "--log-format", "none", "--fp16")) == 0
    scaled = load_checkpoint(tmp_path / "fp16" / "checkpoint_last.pt")
    assert set(scaled) == DOCUMENTED_KEYS | {"loss_scale"}
    assert scaled["loss_scale"] == {"scale": 128.0, "clean_updates": 3}


def test_the_layout_docstring_lists_every_top_level_key():
    docstring = checkpoint_layout.__doc__ or ""
    block = docstring.split("::\n\n", 1)[1].split("\n\n", 1)[0]
    listed = {match.group(1) for match in re.finditer(r"^    (\w+) ", block, re.MULTILINE)}
    assert listed == DOCUMENTED_KEYS | OPTIONAL_KEYS, (
        f"hetfair/checkpoint/layout.py's docstring lists {sorted(listed)}; the checkpoint writes "
        f"{sorted(DOCUMENTED_KEYS | OPTIONAL_KEYS)}")


def as_format_1(state: dict[str, Any]) -> dict[str, Any]:
    """The layout hetfair 0.1 wrote: bare ``wall`` seconds, ``balance: None``, per-rank stats by string key."""
    old = {key: value for key, value in state.items() if key != "clock"}
    old["format_version"] = 1
    old["wall"] = state["clock"]["wall_seconds"]
    old["balance"] = None
    stats = dict(state["epoch_stats"])
    stats.pop("timed_samples")  # format 1 had the timed samples only, under "samples"
    stats["per_rank"] = {"samples": stats.pop("samples"), "compute_seconds": stats.pop("compute_seconds")}
    old["epoch_stats"] = stats
    return old


def test_a_format_1_checkpoint_resumes_exactly(tmp_path, capsys):
    full = tmp_path / "full"
    assert train_main(toy_args(full, "--max-update", "20", "--log-format", "none")) == 0

    resumed = tmp_path / "resumed"
    assert train_main(toy_args(resumed, "--max-update", "6", "--log-format", "none")) == 0
    last = resumed / "checkpoint_last.pt"
    state = load_checkpoint(last)
    wall_before = state["clock"]["wall_seconds"]
    atomic_save(as_format_1(state), last)
    assert torch.load(last, weights_only=True)["format_version"] == 1

    capsys.readouterr()
    assert train_main(toy_args(resumed, "--max-update", "20", "--log-format", "json", "--log-interval", "1")) == 0
    records = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    inner = [r for r in records if r["phase"] == "train_inner"]
    assert inner[0]["num_updates"] == 7 and inner[0]["wall"] > wall_before
    expected, actual = final_parameters(full), final_parameters(resumed)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=1e-6)


def test_a_checkpoint_from_a_newer_format_is_one_clear_error(tmp_path):
    path = tmp_path / "future.pt"
    atomic_save({"format_version": FORMAT_VERSION + 1, "trainer": {}}, path)
    with pytest.raises(CheckpointError, match=f"format {FORMAT_VERSION + 1}, newer than"):
        load_checkpoint(path)


class Counter:
    """A minimal stateful part."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def test_checkpointer_composes_parts_and_leaves_missing_ones_fresh(tmp_path):
    config = CheckpointConfig(save_dir=tmp_path, no_epoch_checkpoints=True)
    Checkpointer(config, {"trainer": Counter(7), "extra": Counter(3)}, {"task": "toy"}, is_master=True).save(
        epoch=1, num_updates=5, end_of_epoch=True, valid_metric=0.5)
    saved = load_checkpoint(tmp_path / "checkpoint_last.pt")
    assert saved["trainer"] == {"value": 7} and saved["extra"] == {"value": 3} and saved["best_metric"] == 0.5
    assert saved["config"] == {"task": "toy"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_best.pt", "checkpoint_last.pt"]

    trainer, extra, newcomer = Counter(), Counter(), Counter(11)
    restorer = Checkpointer(config, {"trainer": trainer, "extra": extra, "newcomer": newcomer}, {}, is_master=True)
    assert restorer.restore() == tmp_path / "checkpoint_last.pt"
    assert (trainer.value, extra.value, newcomer.value, restorer.best_metric) == (7, 3, 11, 0.5)

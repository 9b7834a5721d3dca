"""Progress output formats, TensorBoard scalars read back by TensorBoard, hetfair-validate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import TOY_PLUGIN
from hetfair.checkpoint import load_checkpoint
from hetfair_cli.train import main as train_main
from hetfair_cli.validate import main as validate_main


def toy(save_dir: Path, *extra: str) -> list[str]:
    return ["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--save-dir", str(save_dir), "--max-epoch", "2",
            "--log-interval", "5", *extra]


def test_tensorboard_scalars_are_readable_by_tensorboard(tmp_path):
    logdir = tmp_path / "tb"
    assert train_main(toy(tmp_path / "ckpt", "--tensorboard-logdir", str(logdir), "--log-format", "none")) == 0
    train = EventAccumulator(str(logdir / "train_inner"))
    train.Reload()
    valid = EventAccumulator(str(logdir / "valid"))
    valid.Reload()
    train_tags = set(train.Tags()["scalars"])
    assert {"loss", "accuracy", "lr", "gnorm", "clip", "ups", "wps", "bsz", "share0", "sps0"} <= train_tags
    assert {"loss", "accuracy"} <= set(valid.Tags()["scalars"])
    valid_loss = valid.Scalars("loss")
    assert [event.step for event in valid_loss] == [13, 26]  # 200 samples / 16 = 13 updates per epoch
    assert all(event.value > 0 for event in valid_loss)
    assert train.Scalars("lr")[0].value == pytest.approx(1e-3)
    assert [event.step for event in train.Scalars("loss")] == [5, 10, 15, 20, 25]
    epochs = EventAccumulator(str(logdir / "train"))
    epochs.Reload()
    assert [event.step for event in epochs.Scalars("loss")] == [13, 26]


def test_json_log_lines_carry_the_metrics(tmp_path, capsys):
    assert train_main(toy(tmp_path / "ckpt", "--log-format", "json")) == 0
    records = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    inner = [r for r in records if r["phase"] == "train_inner"]
    assert [r["num_updates"] for r in inner] == [5, 10, 15, 20, 25]
    assert all({"loss", "accuracy", "lr", "gnorm", "ups", "wps", "bsz", "wall"} <= r.keys() for r in inner)
    walls = [r["wall"] for r in inner]
    assert walls == sorted(walls) and walls[0] > 0
    valid = [r for r in records if r["phase"] == "valid"]
    assert len(valid) == 2 and all(0 <= r["accuracy"] <= 100 for r in valid)


def test_simple_log_format_prints_plain_lines(tmp_path, capsys):
    assert train_main(toy(tmp_path / "ckpt", "--log-format", "simple")) == 0
    err = capsys.readouterr().err
    assert "train_inner | epoch 001 | num_updates 5 | loss" in err
    assert "valid | epoch 002 | num_updates 26 | loss" in err


def test_validate_command_reports_the_checkpoint_metrics(tmp_path, capsys):
    save_dir = tmp_path / "ckpt"
    assert train_main(toy(save_dir, "--log-format", "json")) == 0
    last_valid = [json.loads(line) for line in capsys.readouterr().err.splitlines()
                  if line.startswith("{") and '"valid"' in line][-1]
    assert validate_main(["--path", str(save_dir / "checkpoint_last.pt"), "--json", "--valid-subset", "valid"]) == 0
    reported = json.loads(capsys.readouterr().out.strip())
    assert reported["subset"] == "valid"
    assert abs(reported["loss"] - last_valid["loss"]) < 1e-5
    assert abs(reported["accuracy"] - last_valid["accuracy"]) < 1e-6


def test_validate_command_on_a_corrupt_file_is_one_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"garbage")
    assert validate_main(["--path", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "corrupt" in err and len(err.strip().splitlines()) == 1


def test_validate_equals_a_plain_pytorch_evaluation(tmp_path, capsys):
    from toy_plugin import Blobs, ToyMLP

    save_dir = tmp_path / "ckpt"
    assert train_main(toy(save_dir, "--log-format", "none")) == 0
    model = ToyMLP(hidden=16)
    model.load_state_dict(load_checkpoint(save_dir / "checkpoint_last.pt")["trainer"]["model"])
    data = Blobs(60, seed=1)
    with torch.no_grad():
        logits = model(data.inputs)
    expected_loss = torch.nn.functional.cross_entropy(logits, data.labels).item()
    expected_accuracy = 100.0 * (logits.argmax(-1) == data.labels).float().mean().item()
    assert validate_main(["--path", str(save_dir / "checkpoint_last.pt"), "--json"]) == 0
    reported = json.loads(capsys.readouterr().out.strip())
    assert abs(reported["loss"] - expected_loss) < 1e-5
    assert abs(reported["accuracy"] - expected_accuracy) < 1e-4

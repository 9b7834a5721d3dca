"""The example third-party plugin in plugins/hetfair_plugin_example, installed with pip."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

try:
    DISTRIBUTION = metadata.distribution("hetfair-plugin-example")
except metadata.PackageNotFoundError:
    pytest.skip("the example plugin is not installed: run `pip install -e plugins/hetfair_plugin_example`",
                allow_module_level=True)

from hetfair.errors import DataError
from hetfair.options import parse_train_args
from hetfair.tasks import TASK_REGISTRY

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "plugins" / "hetfair_plugin_example" / "hetfair_plugin_example"
ENTRY_POINTS = {
    ("hetfair.tasks", "example_regression"),
    ("hetfair.models", "example_mlp"),
    ("hetfair.archs", "example_mlp_tiny"),
    ("hetfair.archs", "example_linear"),
    ("hetfair.criteria", "mse"),
}


def run_train(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("hetfair-train")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "hetfair_cli.train"]
    env = {key: value for key, value in os.environ.items() if key != "HETFAIR_DEBUG"}
    return subprocess.run(command + list(argv), check=False, capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def build(*argv: str):
    """Parsed args, task, model and criterion of ``example_regression``."""
    args = parse_train_args(["--task", "example_regression", *argv])
    task = TASK_REGISTRY.get(args.task).setup_task(args)
    return args, task, task.build_model(args), task.build_criterion(args)


def test_distribution_declares_its_entry_points():
    declared = {(ep.group, ep.name) for ep in DISTRIBUTION.entry_points}
    assert ENTRY_POINTS <= declared


def test_list_plugins_shows_the_distribution(tmp_path):
    result = run_train("--list-plugins", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for _, name in ENTRY_POINTS:
        line = next(line for line in result.stdout.splitlines() if line.split()[:1] == [name])
        assert "distribution 'hetfair-plugin-example'" in line


def test_task_option_defaults_pick_its_arch_and_criterion():
    args = parse_train_args(["--task", "example_regression"])
    assert (args.arch, args.model, args.criterion) == ("example_mlp_tiny", "example_mlp", "mse")
    assert (args.max_sentences, args.hidden_dim, args.num_hidden_layers) == (32, 8, 1)


def test_also_works_as_a_user_dir():
    args = parse_train_args(["--user-dir", str(PACKAGE_DIR), "--task", "example_regression", "--arch", "example_linear"])
    assert (args.model, args.num_hidden_layers) == ("example_mlp", 0)


def test_data_is_generated_from_the_seed():
    def split(seed: int, name: str) -> torch.Tensor:
        return build("--seed", str(seed), "--num-samples", "40")[1].dataset(name).tensors[1]

    assert torch.equal(split(1, "train"), split(1, "train"))
    assert not torch.equal(split(1, "train"), split(2, "train"))
    assert (len(split(1, "train")), len(split(1, "valid"))) == (40, 10)
    with pytest.raises(DataError, match="no split 'dev'"):
        build()[1].dataset("dev")


def test_batches_follow_the_trainer_contract():
    _, task, model, criterion = build("--input-dim", "3")
    dataset = task.dataset("train")
    sample = task.collater([dataset[i] for i in range(5)])
    assert sample["nsentences"] == 5 and "ntokens" not in sample  # vectors: no tokens to count
    assert model(**sample["net_input"]).shape == sample["target"].shape == (5, 1)

    loss, sample_size, logging_output = criterion(model, sample)
    with torch.no_grad():
        expected = (model(**sample["net_input"]) - sample["target"]).pow(2).sum()
    assert torch.allclose(loss, expected), "the loss is a sum over samples, not a mean"
    assert sample_size == 5
    assert logging_output == pytest.approx(
        {"loss": float(expected), "sample_size": 5.0, "nsentences": 5.0})


def test_a_few_updates_fit_the_data():
    args, task, model, criterion = build("--arch", "example_linear", "--noise", "0")
    loader = torch.utils.data.DataLoader(task.dataset("train"), batch_size=args.max_sentences,
                                         collate_fn=task.collater)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)

    def epoch_loss(train: bool) -> float:
        total, count = 0.0, 0
        for sample in loader:
            loss, sample_size, _ = criterion(model, sample)
            if train:
                optimizer.zero_grad()
                (loss / sample_size).backward()
                optimizer.step()
            total, count = total + float(loss.detach()), count + sample_size
        return total / count

    before = epoch_loss(train=False)
    for _ in range(5):
        epoch_loss(train=True)
    assert epoch_loss(train=False) < 0.05 * before


@pytest.mark.skipif(importlib.util.find_spec("hetfair.run.training") is None,
                    reason="hetfair.run.training (the trainer) does not exist yet")
def test_trains_end_to_end_from_the_command_line(tmp_path):
    result = run_train("--task", "example_regression", "--max-epoch", "1", "--no-save", "--cpu",
                       "--num-samples", "64", "--log-format", "simple", "--save-dir", str(tmp_path / "ckpt"),
                       cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr

"""The optimizer and LR-scheduler plugin example of docs/plugins.md, run as it stands against the contract it states."""

from __future__ import annotations

import json
import re

import pytest

from helpers import REPO_ROOT, TOY_PLUGIN
from hetfair.checkpoint.layout import load_checkpoint
from hetfair.plugins import import_user_dir
from hetfair_cli.train import main as train_main


def docs_example() -> str:
    """The ```python block of docs/plugins.md that starts with ``# my_optim/__init__.py``."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO_ROOT / "docs" / "plugins.md").read_text(), flags=re.S)
    return next(block for block in blocks if block.startswith("# my_optim/__init__.py"))


@pytest.fixture(scope="module")
def my_optim(tmp_path_factory: pytest.TempPathFactory):
    package = tmp_path_factory.mktemp("docs") / "my_optim"
    package.mkdir()
    (package / "__init__.py").write_text(docs_example())
    return import_user_dir(package)


def toy(save_dir, *extra: str) -> list[str]:
    return ["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--save-dir", str(save_dir), "--log-format", "json",
            "--optimizer", "rmsprop", "--lr-scheduler", "halve_on_plateau", "--lr", "0.05", *extra]


def test_the_example_scheduler_follows_its_contract(my_optim, tmp_path, capsys):
    assert train_main(toy(tmp_path / "ckpt", "--max-epoch", "6")) == 0
    records = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    valid = [r["loss"] for r in records if r["phase"] == "valid"]
    epoch_lr = {r["epoch"]: r["lr"] for r in records if r["phase"] == "train"}
    factor, best = 1.0, None
    for epoch, loss in enumerate(valid, 1):
        assert epoch_lr[epoch] == pytest.approx(0.05 * factor)  # decayed_lr during the epoch
        if best is not None and loss >= best:  # step_epoch after its validation
            factor *= 0.5
        best = loss if best is None else min(best, loss)
    state = load_checkpoint(tmp_path / "ckpt" / "checkpoint_last.pt")["trainer"]
    assert state["lr_scheduler"] == {"factor": factor, "best": pytest.approx(best)}  # its state_dict
    assert state["optimizer"]["param_groups"][0]["alpha"] == 0.99  # torch_kwargs reached torch.optim.RMSprop


def test_the_example_optimizer_settings_follow_the_command_line_on_resume(my_optim, tmp_path, capsys):
    assert train_main(toy(tmp_path / "ckpt", "--max-epoch", "1")) == 0
    assert train_main(toy(tmp_path / "ckpt", "--max-epoch", "2", "--rmsprop-alpha", "0.9", "--log-format",
                          "simple")) == 0
    assert ("restore | optimizer settings from the command line replace the checkpoint's: alpha 0.9 (was 0.99)"
            in capsys.readouterr().err.splitlines())
    group = load_checkpoint(tmp_path / "ckpt" / "checkpoint_last.pt")["trainer"]["optimizer"]["param_groups"][0]
    assert group["alpha"] == 0.9


def test_the_example_scheduler_checks_its_options(my_optim, tmp_path, capsys):
    assert train_main(toy(tmp_path / "ckpt", "--lr-shrink", "2", "--max-update", "1")) == 2
    assert capsys.readouterr().err == "hetfair-train: error: --lr-shrink must be in (0, 1), got 2.0\n"


def test_a_criterion_that_logs_no_counts_still_gets_sps_and_bsz_from_the_collaters_batch(tmp_path, capsys):
    assert train_main(["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--criterion", "toy_loss_only",
                       "--max-update", "3", "--log-interval", "1", "--max-sentences", "16", "--no-save",
                       "--disable-validation", "--log-format", "json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    inner = [r for r in records if r["phase"] == "train_inner"]
    assert len(inner) == 3 and all(r["bsz"] == 16.0 and r["sps"] > 0 for r in inner)
    assert all(r["sps"] == pytest.approx(16.0 * r["ups"], rel=1e-3) for r in inner)  # 16 samples an update
    assert not any("wps" in r for r in inner)  # the toy's samples are vectors: no tokens to count

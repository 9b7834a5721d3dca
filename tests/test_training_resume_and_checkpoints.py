"""Single-process training: exact resume, atomic checkpoints, bad checkpoints, TensorBoard."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import TOY_PLUGIN, final_parameters, subprocess_env, train_command
from hetfair.checkpoint import atomic_save, load_checkpoint
from hetfair.errors import CheckpointError
from hetfair_cli.train import main as train_main


def toy_args(save_dir: Path, *extra: str) -> list[str]:
    return [
        "--user-dir", str(TOY_PLUGIN), "--task", "toy", "--save-dir", str(save_dir), "--log-format", "none",
        "--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.2", "--lr-scheduler", "polynomial_decay",
        "--warmup-updates", "3", "--total-num-update", "30", "--max-sentences", "16", *extra,
    ]


def run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(train_command(*args), capture_output=True, text=True, env=subprocess_env(), timeout=120)


@pytest.mark.parametrize("extra", [(), ("--update-freq", "2", "--num-workers", "2")])
def test_interrupted_and_resumed_run_matches_uninterrupted_run(tmp_path, extra):
    # 200 samples / 16 per step = 13 steps per epoch; updates 5 and 17 stop mid-epoch.
    full = tmp_path / "full"
    assert train_main(toy_args(full, "--max-update", "24", *extra)) == 0

    resumed = tmp_path / "resumed"
    assert train_main(toy_args(resumed, "--max-update", "5", *extra)) == 0
    first_stop = load_checkpoint(resumed / "checkpoint_last.pt")
    assert first_stop["trainer"]["num_updates"] == 5 and first_stop["position"]["samples_done"] > 0
    assert train_main(toy_args(resumed, "--max-update", "17", *extra)) == 0
    assert train_main(toy_args(resumed, "--max-update", "24", *extra)) == 0

    expected, actual = final_parameters(full), final_parameters(resumed)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=1e-6)
    assert load_checkpoint(resumed / "checkpoint_last.pt")["trainer"]["num_updates"] == 24


def test_resume_skips_work_already_done(tmp_path):
    save_dir = tmp_path / "ckpt"
    assert train_main(toy_args(save_dir, "--max-epoch", "1")) == 0
    before = final_parameters(save_dir)
    assert train_main(toy_args(save_dir, "--max-epoch", "1")) == 0  # same command: nothing left to do
    after = final_parameters(save_dir)
    for name in before:
        assert torch.equal(before[name], after[name])


def test_checkpoint_files_and_pruning(tmp_path):
    save_dir = tmp_path / "ckpt"
    assert train_main(toy_args(save_dir, "--max-epoch", "3", "--save-interval-updates", "4",
                               "--keep-interval-updates", "2", "--keep-last-epochs", "1")) == 0
    names = sorted(p.name for p in save_dir.iterdir())
    assert "checkpoint_last.pt" in names and "checkpoint_best.pt" in names
    assert [n for n in names if n.startswith("checkpoint") and n[10:11].isdigit()] == ["checkpoint3.pt"]
    update_files = sorted((n for n in names if n.startswith("checkpoint_") and n[11].isdigit()),
                          key=lambda n: int(n.rsplit("_", 1)[1][:-3]))
    assert update_files == ["checkpoint_3_32.pt", "checkpoint_3_36.pt"]
    assert not [n for n in names if n.endswith(".tmp")]


def test_best_checkpoint_follows_the_chosen_metric(tmp_path):
    save_dir = tmp_path / "ckpt"
    assert train_main(toy_args(save_dir, "--max-epoch", "2", "--best-checkpoint-metric", "accuracy",
                               "--maximize-best-checkpoint-metric")) == 0
    best = load_checkpoint(save_dir / "checkpoint_best.pt")
    last = load_checkpoint(save_dir / "checkpoint_last.pt")
    assert last["best_metric"] == best["best_metric"] or last["best_metric"] >= best["best_metric"]
    assert 0.0 <= best["best_metric"] <= 100.0


def test_unknown_best_metric_is_one_clear_error(tmp_path, capsys):
    code = train_main(toy_args(tmp_path / "c", "--max-epoch", "1", "--best-checkpoint-metric", "bleu"))
    err = capsys.readouterr().err.strip()
    assert code == 2 and "bleu" in err and "accuracy" in err and len(err.splitlines()) == 1


class _FailsToPickle:
    def __reduce__(self):
        raise RuntimeError("disk went away mid-write")


def test_failed_write_leaves_previous_checkpoint_loadable(tmp_path):
    path = tmp_path / "checkpoint_last.pt"
    good = {"format_version": 1, "trainer": {"weights": torch.arange(1000.0)}}
    atomic_save(good, path)
    with pytest.raises(RuntimeError, match="mid-write"):
        atomic_save({"format_version": 1, "trainer": {"weights": torch.ones(10), "bad": _FailsToPickle()}}, path)
    assert torch.equal(load_checkpoint(path)["trainer"]["weights"], torch.arange(1000.0))
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint_last.pt"]


def test_killed_writer_never_leaves_a_torn_checkpoint(tmp_path):
    """SIGKILL a process that keeps rewriting a large checkpoint; the file always loads."""
    path = tmp_path / "checkpoint_last.pt"
    atomic_save({"format_version": 1, "trainer": {"step": 0}}, path)
    writer = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from hetfair.checkpoint import atomic_save\n"
        "big = torch.randn(8_000_000)\n"
        "for step in range(1, 1000):\n"
        "    atomic_save({'format_version': 1, 'trainer': {'step': step, 'big': big}}, Path(sys.argv[1]))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", writer, str(path)], env=subprocess_env())
    time.sleep(4.0)
    proc.kill()
    proc.wait()
    state = load_checkpoint(path)
    assert isinstance(state["trainer"]["step"], int)


def test_corrupt_checkpoint_is_one_clear_error(tmp_path):
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    (save_dir / "checkpoint_last.pt").write_bytes(b"\x80\x02 this is not a checkpoint")
    result = run(toy_args(save_dir, "--max-epoch", "1"))
    assert result.returncode == 2
    assert "corrupt" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_incompatible_checkpoint_is_one_clear_error(tmp_path):
    save_dir = tmp_path / "ckpt"
    assert train_main(toy_args(save_dir, "--max-update", "2")) == 0
    result = run(toy_args(save_dir, "--max-update", "4", "--arch", "toy_mlp_wide"))
    assert result.returncode == 2
    assert "does not fit this model" in result.stderr and "Traceback" not in result.stderr


def test_missing_restore_file_is_one_clear_error(tmp_path, capsys):
    code = train_main(toy_args(tmp_path / "c", "--max-epoch", "1", "--restore-file", "nope.pt"))
    err = capsys.readouterr().err
    assert code == 2 and "nope.pt" in err


def test_checkpoint_holds_plain_config_and_loads_weights_only(tmp_path):
    save_dir = tmp_path / "ckpt"
    assert train_main(toy_args(save_dir, "--max-update", "3")) == 0
    state = torch.load(save_dir / "checkpoint_last.pt", weights_only=True)
    assert state["config"]["task"] == "toy" and state["config"]["lr"] == 0.2
    assert all(isinstance(v, (int, float, str, bool, list, type(None))) for v in state["config"].values())


def test_damaged_checkpoint_error_type():
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(Path("/nonexistent/checkpoint.pt"))

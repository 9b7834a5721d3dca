"""Single-process training: exact resume, atomic checkpoints, bad checkpoints, TensorBoard."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import TOY_PLUGIN, final_parameters, run_train, subprocess_env
from hetfair.checkpoint.layout import atomic_save, load_checkpoint
from hetfair.errors import CheckpointError, first_line
from hetfair.utils import state_dict_mismatch
from hetfair_cli.train import main as train_main


def toy_args(save_dir: Path, *extra: str) -> list[str]:
    return [
        "--user-dir", str(TOY_PLUGIN), "--task", "toy", "--save-dir", str(save_dir), "--log-format", "none",
        "--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.2", "--lr-scheduler", "polynomial_decay",
        "--warmup-updates", "3", "--total-num-update", "30", "--max-sentences", "16", *extra,
    ]


def run(args: list[str]) -> subprocess.CompletedProcess:
    return run_train(args, Path.cwd(), timeout=120)


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
        "from hetfair.checkpoint.layout import atomic_save\n"
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


def test_incompatible_checkpoint_says_which_checkpoint_which_keys_and_how_to_start_afresh(tmp_path):
    save_dir = tmp_path / "ckpt"
    assert train_main(toy_args(save_dir, "--max-update", "2")) == 0
    result = run(toy_args(save_dir, "--max-update", "4", "--arch", "toy_mlp_wide"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    line = lines[0]
    assert f"cannot resume from {save_dir / 'checkpoint_last.pt'} (resumed automatically" in line
    assert "it does not fit model ToyMLP: 3 keys of another shape: net.0.weight (16x8 in the checkpoint, 64x8 in the " \
           "model), net.0.bias (16 in the checkpoint, 64 in the model), net.2.weight (3x16" in line
    assert "written with --arch toy_mlp, this run has --arch toy_mlp_wide" in line
    assert line.endswith(f"to start afresh, pass another --save-dir (or move {save_dir / 'checkpoint_last.pt'} away)")


def test_state_dict_mismatch_counts_and_names_the_first_keys():
    model = {f"layer{i}.weight": torch.zeros(2, 2) for i in range(5)}
    loaded = {"layer0.weight": torch.zeros(3, 2), "extra": torch.zeros(1)}
    assert state_dict_mismatch(model, loaded, shown=2) == (
        "4 keys missing: layer1.weight, layer2.weight, ... (2 more); 1 key unexpected: extra; "
        "1 key of another shape: layer0.weight (3x2 in the checkpoint, 2x2 in the model)")
    assert state_dict_mismatch(model, dict(model)) == ""


def test_first_line_keeps_the_details_a_heading_announces():
    error = RuntimeError('Error(s) in loading state_dict for Net:\n\tMissing key(s) in state_dict: "bias". \n\t'
                         'Unexpected key(s) in state_dict: "extra". ')
    assert first_line(error) == ('Error(s) in loading state_dict for Net: Missing key(s) in state_dict: "bias".; '
                                 'Unexpected key(s) in state_dict: "extra".')
    assert first_line(RuntimeError("one line\nand more")) == "one line"
    assert first_line(RuntimeError("\x1b[1mbold\x1b[0m")) == "bold"
    assert first_line(ValueError("")) == "ValueError"
    assert first_line(RuntimeError("x" * 500), limit=20) == "x" * 17 + "..."


class NotPlainData:
    """Stands for an object a checkpoint must not hold."""


def test_checkpoint_holding_python_objects_names_them(tmp_path):
    path = tmp_path / "checkpoint_last.pt"
    torch.save({"format_version": 2, "trainer": {"model": NotPlainData()}}, path)
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path)
    message = str(caught.value)
    assert "\n" not in message
    assert f"Unsupported global: GLOBAL {__name__}.NotPlainData" in message
    assert "weights_only=True" in message


def test_finished_job_run_again_says_there_is_nothing_to_do(tmp_path, capsys):
    save_dir = tmp_path / "ckpt"
    assert train_main(toy_args(save_dir, "--max-epoch", "2")) == 0
    assert train_main(toy_args(save_dir, "--max-epoch", "2", "--log-format", "simple")) == 0
    err = capsys.readouterr().err
    assert (f"nothing to do: --max-epoch 2 reached ({save_dir / 'checkpoint_last.pt'} has 26 updates); "
            f"raise --max-epoch to train further") in err.splitlines()
    assert train_main(toy_args(save_dir, "--max-update", "20", "--log-format", "simple")) == 0
    assert "nothing to do: --max-update 20 reached" in capsys.readouterr().err


def test_a_run_ends_with_one_summary_line(tmp_path, capsys):
    save_dir, logdir = tmp_path / "ckpt", tmp_path / "tb"
    assert train_main(toy_args(save_dir, "--max-epoch", "2", "--log-format", "simple",
                               "--tensorboard-logdir", str(logdir))) == 0
    lines = capsys.readouterr().err.splitlines()
    best = load_checkpoint(save_dir / "checkpoint_best.pt")["best_metric"]
    best_file, last_file = (re.escape(str(save_dir / name)) for name in ("checkpoint_best.pt", "checkpoint_last.pt"))
    assert re.fullmatch(rf"done \| num_updates 26 \| epochs 2 \| wall 0:\d\d:\d\d \| best loss {best:.3f} "
                        rf"\({best_file}\) \| last {last_file}", lines[-2]), lines[-2]
    assert lines[-1] == f"TensorBoard logs are in {logdir}; view them with: tensorboard --logdir {logdir}"


def test_resume_applies_the_optimizer_settings_of_the_command_line(tmp_path, capsys):
    save_dir = tmp_path / "ckpt"
    assert train_main(toy_args(save_dir, "--max-update", "5", "--weight-decay", "0.0")) == 0
    assert train_main(toy_args(save_dir, "--max-update", "8", "--momentum", "0.5", "--nesterov",
                               "--weight-decay", "0.01", "--log-format", "simple")) == 0
    notice = [line for line in capsys.readouterr().err.splitlines() if "optimizer settings" in line]
    assert notice == ["restore | optimizer settings from the command line replace the checkpoint's: "
                      "momentum 0.5 (was 0.9), weight_decay 0.01 (was 0.0), nesterov True (was False)"]
    state = load_checkpoint(save_dir / "checkpoint_last.pt")
    group = state["trainer"]["optimizer"]["param_groups"][0]
    assert (group["momentum"], group["weight_decay"], group["nesterov"]) == (0.5, 0.01, True)
    assert (state["config"]["momentum"], state["config"]["weight_decay"]) == (0.5, 0.01)


def test_resume_with_the_same_optimizer_settings_says_nothing_about_them(tmp_path, capsys):
    save_dir = tmp_path / "ckpt"
    assert train_main(toy_args(save_dir, "--max-update", "5")) == 0
    assert train_main(toy_args(save_dir, "--max-update", "8", "--log-format", "simple")) == 0
    assert "optimizer settings" not in capsys.readouterr().err


def test_a_no_save_run_starts_afresh_beside_a_checkpoint_and_says_so(tmp_path, capsys):
    save_dir = tmp_path / "ckpt"
    assert train_main(toy_args(save_dir, "--max-update", "5")) == 0
    written = (save_dir / "checkpoint_last.pt").read_bytes()
    capsys.readouterr()
    assert train_main(toy_args(save_dir, "--max-update", "3", "--no-save", "--arch", "toy_mlp_wide",
                               "--log-format", "simple")) == 0  # another model: resuming would fail
    lines = capsys.readouterr().err.splitlines()
    last = save_dir / "checkpoint_last.pt"
    assert f"restore | not resuming from {last}: a --no-save run starts afresh (--restore-file {last} resumes " \
           f"from it)" in lines
    assert any(line.startswith("done | num_updates 3 |") for line in lines)
    assert last.read_bytes() == written


def test_a_no_save_run_resumes_from_a_named_restore_file(tmp_path, capsys):
    save_dir = tmp_path / "ckpt"
    assert train_main(toy_args(save_dir, "--max-update", "5")) == 0
    capsys.readouterr()
    assert train_main(toy_args(save_dir, "--max-update", "8", "--no-save", "--log-format", "simple",
                               "--restore-file", str(save_dir / "checkpoint_last.pt"))) == 0
    lines = capsys.readouterr().err.splitlines()
    assert "restore | epoch 001 | num_updates 5 | samples_done 80" in lines  # the epoch once
    assert any(line.startswith("done | num_updates 8 |") for line in lines)


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

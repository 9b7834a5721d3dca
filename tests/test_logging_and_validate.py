"""Progress output formats, TensorBoard scalars read back by TensorBoard, hetfair-validate."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import TENSORS, EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from helpers import TOY_PLUGIN
from hetfair.checkpoint.layout import load_checkpoint
from hetfair.logging.progress import Progress, format_metric, format_metrics
from hetfair.run.training import TrainingRun
from hetfair_cli.train import main as train_main
from hetfair_cli.validate import main as validate_main

# The toy task: 200 samples in batches of 16 make 13 updates per epoch (12 of 16 samples, one of 8).
INNER_STEPS = [5, 10, 13, 15, 20, 25, 26]  # every --log-interval 5 updates, and at each epoch's end


def validate_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "hetfair_cli.validate", *args]


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
    assert {"loss", "accuracy", "lr", "gnorm", "clip", "ups", "sps", "bsz", "share0", "sps0"} <= train_tags
    assert "wps" not in train_tags  # the toy task's samples are vectors: no tokens, no words per second
    assert {"loss", "accuracy"} <= set(valid.Tags()["scalars"])
    valid_loss = valid.Scalars("loss")
    assert [event.step for event in valid_loss] == [13, 26]  # 200 samples / 16 = 13 updates per epoch
    assert all(event.value > 0 for event in valid_loss)
    assert train.Scalars("lr")[0].value == pytest.approx(1e-3)
    assert [event.step for event in train.Scalars("loss")] == INNER_STEPS
    epochs = EventAccumulator(str(logdir / "train"))
    epochs.Reload()
    assert [event.step for event in epochs.Scalars("loss")] == [13, 26]


def custom_scalars_layout(run_dir: Path) -> layout_pb2.Layout:
    """The custom-scalars layout stored in a TensorBoard run, as TensorBoard's plugin reads it."""
    events = EventAccumulator(str(run_dir), size_guidance={TENSORS: 0})
    events.Reload()
    assert "custom_scalars__config__" in events.Tags()["tensors"]
    tensor = events.Tensors("custom_scalars__config__")[-1].tensor_proto
    return layout_pb2.Layout.FromString(tensor.string_val[0])


def test_tensorboard_layout_puts_every_rank_on_one_chart(tmp_path):
    logdir = tmp_path / "tb"
    assert train_main(toy(tmp_path / "ckpt", "--tensorboard-logdir", str(logdir), "--log-format", "none",
                          "--max-epoch", "1")) == 0
    layout = custom_scalars_layout(logdir / "train_inner")
    charts = {chart.title.split(":")[0]: list(chart.multiline.tag) for category in layout.category
              for chart in category.chart}
    assert charts == {"share{r}": [r"^share\d+$"], "sps{r}": [r"^sps\d+$"], "balance_eff": [r"^balance_eff$"]}
    # the patterns cover exactly the per-rank tags training wrote
    written = EventAccumulator(str(logdir / "train_inner"))
    written.Reload()
    tags = written.Tags()["scalars"]
    assert [tag for tag in tags if re.match(charts["share{r}"][0], tag)] == ["share0"]
    assert [tag for tag in tags if re.match(charts["sps{r}"][0], tag)] == ["sps0"]


def test_json_log_lines_carry_the_metrics(tmp_path, capsys):
    assert train_main(toy(tmp_path / "ckpt", "--log-format", "json")) == 0
    records = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    inner = [r for r in records if r["phase"] == "train_inner"]
    assert [r["num_updates"] for r in inner] == INNER_STEPS
    assert all({"loss", "accuracy", "lr", "gnorm", "ups", "sps", "bsz", "wall"} <= r.keys() for r in inner)
    walls = [r["wall"] for r in inner]
    assert walls == sorted(walls) and walls[0] > 0
    valid = [r for r in records if r["phase"] == "valid"]
    assert len(valid) == 2 and all(0 <= r["accuracy"] <= 100 for r in valid)


def json_records(err: str, phase: str) -> list[dict]:
    return [r for r in (json.loads(line) for line in err.splitlines() if line.startswith("{")) if r["phase"] == phase]


def test_train_inner_lines_never_span_two_epochs(tmp_path, capsys):
    assert train_main(toy(tmp_path / "ckpt", "--log-format", "json")) == 0
    bsz = {r["num_updates"]: r["bsz"] for r in json_records(capsys.readouterr().err, "train_inner")}
    assert bsz[13] == pytest.approx((16 + 16 + 8) / 3)  # updates 11-13: the end of epoch 1
    assert bsz[15] == pytest.approx(16)  # updates 14-15 only, not 11-15


def test_validation_time_does_not_count_as_training_time(tmp_path, capsys, monkeypatch):
    real_clock, offset = time.perf_counter, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + offset[0])
    validate = TrainingRun.validate

    def validation_taking_1000_seconds(self):
        offset[0] += 1000.0
        return validate(self)

    monkeypatch.setattr(TrainingRun, "validate", validation_taking_1000_seconds)
    assert train_main(toy(tmp_path / "ckpt", "--log-format", "json", "--validate-interval-updates", "4")) == 0
    err = capsys.readouterr().err
    assert len(json_records(err, "valid")) == 8  # after updates 4, 8, 12, 13, 17, 21, 25, 26
    # had validation counted, no interval could exceed 5 updates per 1000 s
    for record in json_records(err, "train_inner") + json_records(err, "train"):
        assert record["ups"] > 0.1, record


def test_simple_log_format_prints_plain_lines(tmp_path, capsys):
    assert train_main(toy(tmp_path / "ckpt", "--log-format", "simple")) == 0
    err = capsys.readouterr().err
    assert "train_inner | epoch 001 | num_updates 5 | loss" in err
    assert "valid | epoch 002 | num_updates 26 | loss" in err


def test_numbers_have_a_fixed_number_of_decimals_per_metric():
    assert format_metrics({"loss": 1.0, "accuracy": 100.0, "clip": 0.0, "ups": 3.14159, "bsz": 64.0, "wall": 12.6,
                           "share1": 25.0, "sps1": 1234.56, "balance_eff": 1.0, "mlm_accuracy": 50.0}) == (
        "loss 1.000 | accuracy 100.00 | clip 0.0 | ups 3.14 | bsz 64.0 | wall 13 | share1 25.0 | sps1 1234.6"
        " | balance_eff 1.000 | mlm_accuracy 50.00")
    assert [format_metric("lr", lr) for lr in (1e-3, 5e-05, 0.00049987)] == ["0.001", "5e-05", "0.0004999"]
    assert format_metric("parameters", 1234567) == "1234567"


def test_training_lines_use_the_number_format(tmp_path, capsys):
    assert train_main(toy(tmp_path / "ckpt", "--log-format", "simple")) == 0
    for line in capsys.readouterr().err.splitlines():
        if line.startswith(("train_inner |", "train |", "valid |")):
            fields = dict(field.split(" ", 1) for field in line.split(" | ")[3:])
            assert re.fullmatch(r"\d+\.\d{3}", fields["loss"]), line
            assert re.fullmatch(r"\d+\.\d{2}", fields["accuracy"]), line


def test_validate_prints_what_training_printed_for_the_same_checkpoint(tmp_path, capsys):
    save_dir = tmp_path / "ckpt"
    assert train_main(toy(save_dir, "--log-format", "simple")) == 0
    last_valid = [line for line in capsys.readouterr().err.splitlines() if line.startswith("valid |")][-1]
    assert validate_main(["--path", str(save_dir / "checkpoint_last.pt"), "--valid-subset", "valid"]) == 0
    out = capsys.readouterr().out.strip()
    metrics = last_valid.split(" | ", 3)[3]  # after "valid | epoch 002 | num_updates 26"
    assert out == f"valid | {metrics}"


def test_the_bars_loss_moves_with_every_update(tmp_path, capsys, monkeypatch):
    shown: list[str] = []
    step = Progress.step

    def recording_step(progress: Progress, *args, **kwargs) -> None:
        step(progress, *args, **kwargs)
        shown.append(progress._bar.postfix)

    monkeypatch.setattr(Progress, "step", recording_step)
    assert train_main(toy(tmp_path / "ckpt", "--log-format", "tqdm", "--max-epoch", "1", "--log-interval", "10",
                          "--lr", "0.05")) == 0
    inner_losses = [re.search(r"\| loss (\S+) \|", line).group(1)
                    for line in capsys.readouterr().err.splitlines() if line.startswith("train_inner |")]
    assert len(shown) == 13 and len(set(shown[:10])) == 10, shown  # a new value after each update
    # The updates since the last train_inner line: at updates 10 and 13 (the epoch's end) the lines' own loss.
    assert [shown[9], shown[12]] == [f"loss={loss}" for loss in inner_losses]


FOUR_RANK_METRICS = {"loss": 2.302585, "accuracy": 11.25, "lr": 0.001, "gnorm": 1.234567, "clip": 0.0,
                     "ups": 12.345, "wps": 3456.78, "bsz": 64.0,
                     **{f"share{r}": 25.0 for r in range(4)}, **{f"sps{r}": 1234.5 + r for r in range(4)},
                     "balance_eff": 0.987654, "wall": 123.4}


def test_tqdm_bar_keeps_its_width_in_a_160_column_terminal():
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    screen: list[bytes] = []
    reader = threading.Thread(target=lambda: _drain(controller, screen), daemon=True)
    reader.start()
    with os.fdopen(terminal, "w") as stream:
        progress = Progress(None, enabled=True, stream=stream)
        assert progress.format == "tqdm"  # a terminal gets the bar by default
        progress.start_epoch(1, 100, 0)
        for update in range(1, 51):
            progress.step()
            if update % 10 == 0:
                progress.log("train_inner", FOUR_RANK_METRICS, 1, update)
        progress.end_epoch()
    reader.join(timeout=10)
    output = b"".join(screen).decode()
    bars = re.findall(r"epoch 001:\s+\d+%\|([^|]*)\|", output)
    assert bars and min(len(bar) for bar in bars) >= 40, bars
    assert "train_inner | epoch 001 | num_updates 50 | loss 2.303" in output  # the full line, above the bar


def _drain(fd: int, chunks: list[bytes]) -> None:
    """Read a pty's output until the terminal side is closed."""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the other side closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)


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


def test_validate_into_a_closed_pipe_ends_quietly(tmp_path):
    save_dir = tmp_path / "ckpt"
    assert train_main(toy(save_dir, "--log-format", "none", "--max-epoch", "1")) == 0
    reader, writer = os.pipe()
    os.close(reader)  # like `| head -1` once head has gone: nobody reads the lines
    try:
        result = subprocess.run(validate_command("--path", str(save_dir / "checkpoint_last.pt"),
                                                 "--valid-subset", "valid,test", "--user-dir", str(TOY_PLUGIN)),
                                stdout=writer, stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    finally:
        os.close(writer)
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr, result.stderr
    assert result.returncode == 141


def test_validate_evaluates_no_further_split_once_its_reader_has_gone(tmp_path):
    save_dir, pause = tmp_path / "ckpt", tmp_path / "pause"
    assert train_main(toy(save_dir, "--log-format", "none", "--max-epoch", "1", "--toy-held-split", "held",
                          "--toy-pause-file", str(pause))) == 0
    pause.touch()  # loading the split 'held' now waits until the file is gone
    process = subprocess.Popen(validate_command("--path", str(save_dir / "checkpoint_last.pt"), "--valid-subset",
                                                "valid,held", "--user-dir", str(TOY_PLUGIN)),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().startswith("valid | loss ")
        process.stdout.close()  # what `| head -1` does once it has its line
        try:
            returncode = process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            returncode = None  # still waiting to evaluate 'held', for nobody
    finally:
        pause.unlink()
        stderr = process.communicate(timeout=120)[1]
    assert returncode == 141, f"hetfair-validate went on to the next split after its reader had gone: {stderr}"
    assert stderr == ""

"""Background checkpoint writes: a snapshot of the save's update, one write at a time, errors surface,
a killed run leaves a checkpoint that loads and resumes."""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import hetfair.checkpoint.layout
from helpers import TOY_PLUGIN, start
from hetfair.checkpoint.layout import CheckpointConfig, Checkpointer, load_checkpoint
from hetfair.checkpoint.writer import CheckpointWriter, host_snapshot
from hetfair.errors import CheckpointError
from hetfair_cli.train import main as train_main


class Weights:
    """A checkpoint part holding tensors that training changes in place."""

    def __init__(self) -> None:
        self.weight = torch.zeros(4, 3)
        self.momentum = {"buf": torch.zeros(4, 3)}

    def state_dict(self) -> dict[str, Any]:
        return {"weight": self.weight, "optimizer": {"state": self.momentum}, "num_updates": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.weight.copy_(state["weight"])


def test_a_snapshot_shares_no_storage_but_keeps_tied_tensors_tied():
    weight = torch.arange(6.0).reshape(2, 3)
    state = {"model": {"embed": weight, "decoder": weight.detach()}, "steps": [1, {"lr": 0.5}], "rng": (1, 2)}
    copy = host_snapshot(state)
    weight.add_(100.0)
    assert torch.equal(copy["model"]["embed"], torch.arange(6.0).reshape(2, 3))
    assert copy["model"]["embed"] is copy["model"]["decoder"]  # torch.save writes one storage, as before
    assert copy["steps"] == [1, {"lr": 0.5}] and copy["steps"] is not state["steps"] and copy["rng"] == (1, 2)


@pytest.fixture
def slow_disk(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """atomic_save waits until the event is set: the background write is still in flight meanwhile."""
    release = threading.Event()
    original = hetfair.checkpoint.layout.atomic_save

    def held_back(state: dict[str, Any], path: Path, *how: Any) -> None:
        assert release.wait(timeout=60)
        original(state, path, *how)

    monkeypatch.setattr(hetfair.checkpoint.layout, "atomic_save", held_back)
    return release


def test_the_file_holds_the_state_of_the_save_update_not_a_later_one(tmp_path, slow_disk):
    part = Weights()
    checkpointer = Checkpointer(CheckpointConfig(tmp_path, async_save=True), {"trainer": part}, {}, is_master=True)
    part.weight.fill_(1.0)
    part.momentum["buf"].fill_(2.0)
    checkpointer.save(epoch=1, num_updates=1, end_of_epoch=False, valid_metric=None)  # returns before writing
    part.weight.fill_(5.0)  # the next updates change everything in place
    part.momentum["buf"].fill_(6.0)
    slow_disk.set()
    checkpointer.close()
    saved = load_checkpoint(tmp_path / "checkpoint_last.pt")["trainer"]
    assert torch.equal(saved["weight"], torch.ones(4, 3))
    assert torch.equal(saved["optimizer"]["state"]["buf"], torch.full((4, 3), 2.0))


def test_at_most_one_write_is_in_flight():
    writer = CheckpointWriter(background=True)
    first_started, release = threading.Event(), threading.Event()
    running, most = [0], [0]
    lock = threading.Lock()

    def write(first: bool) -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        if first:
            first_started.set()
            assert release.wait(timeout=60)
        with lock:
            running[0] -= 1

    writer.submit(lambda: write(True))
    assert first_started.wait(timeout=60)
    second = threading.Thread(target=writer.submit, args=(lambda: write(False),))
    second.start()
    second.join(timeout=0.5)
    assert second.is_alive()  # the second save waits for the first write
    release.set()
    second.join(timeout=60)
    writer.close()
    assert most[0] == 1


def test_a_failed_background_write_is_raised_at_the_next_check_save_and_close():
    writer = CheckpointWriter(background=True)
    failure = CheckpointError("no space left on device while writing x; the previous checkpoint is intact")

    def fail() -> None:
        raise failure

    writer.submit(fail)
    with pytest.raises(CheckpointError) as caught:
        writer.submit(lambda: None)  # the next save waits for the failed one and reports it
    assert caught.value is failure
    writer.submit(fail)
    deadline = time.monotonic() + 60
    with pytest.raises(CheckpointError):
        while time.monotonic() < deadline:  # check() never waits: poll until the write has ended
            writer.check()
            time.sleep(0.01)
    writer.submit(fail)
    with pytest.raises(CheckpointError):
        writer.close()


def test_training_stops_at_the_update_after_a_background_save_failed(tmp_path, monkeypatch, capsys):
    def full_disk(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(hetfair.checkpoint.layout.os, "fsync", full_disk)
    save_dir = tmp_path / "ckpt"
    args = ["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--save-dir", str(save_dir), "--log-format", "json",
            "--log-interval", "1", "--disable-validation", "--toy-train-size", "100000", "--max-update", "2000",
            "--save-interval-updates", "2"]
    assert train_main(args) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (f"hetfair-train: error: no space left on device while writing "
                                            f"{save_dir / 'checkpoint_1_2.pt'}; no checkpoint was written")
    logged = [json.loads(line)["num_updates"] for line in err.splitlines() if line.startswith("{")]
    assert max(logged) <= 4  # the save after update 2 failed: update 3's boundary, or the save at 4, stops it
    assert not (save_dir / "checkpoint_last.pt").exists()


def toy_saving_every_update(save_dir: Path, max_update: int) -> list[str]:
    # ~4 MB checkpoints (model + Adam state) written after every update
    return ["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--toy-hidden", "30000", "--toy-train-size", "100000",
            "--max-update", str(max_update), "--save-dir", str(save_dir), "--log-format", "simple",
            "--log-interval", "5", "--disable-validation", "--no-epoch-checkpoints", "--save-interval-updates", "1",
            "--keep-interval-updates", "1"]


def test_a_run_killed_while_saving_in_the_background_leaves_a_checkpoint_that_resumes(tmp_path):
    save_dir = tmp_path / "ckpt"
    proc = start(toy_saving_every_update(save_dir, 100000), tmp_path)
    try:
        for line in proc.stderr:
            if "num_updates 10 " in line:
                break
        os.kill(proc.pid, signal.SIGKILL)  # most likely during a background write
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    done = load_checkpoint(save_dir / "checkpoint_last.pt")["trainer"]["num_updates"]
    assert done >= 8  # printed before the save of update 10; that of 9 may be in flight, 8 was on disk
    resumed = start(toy_saving_every_update(save_dir, done + 1), tmp_path)
    _, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, err
    assert load_checkpoint(save_dir / "checkpoint_last.pt")["trainer"]["num_updates"] == done + 1
    assert not [p.name for p in save_dir.iterdir() if p.name.endswith(".tmp")]

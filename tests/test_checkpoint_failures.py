"""Saving can fail (full disk, file-size limit, Ctrl-C): one error line, the previous checkpoint intact,
no temporary file left behind; temporary files of killed runs are removed at start-up."""

from __future__ import annotations

import errno
import os
import resource
import signal
import subprocess
from pathlib import Path

import pytest
import torch

import hetfair.checkpoint
from helpers import TOY_PLUGIN, subprocess_env, train_command
from hetfair.checkpoint import atomic_copy, atomic_save, load_checkpoint
from hetfair.errors import CheckpointError, Interrupted
from hetfair_cli.train import main as train_main


def toy_args(save_dir: Path, *extra: str) -> list[str]:
    return ["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--save-dir", str(save_dir), "--log-format", "none",
            "--disable-validation", "--no-epoch-checkpoints", *extra]


def temp_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_a_write_that_fails_mid_checkpoint_is_one_line_and_keeps_the_previous_one(tmp_path):
    save_dir = tmp_path / "ckpt"
    assert train_main(toy_args(save_dir, "--max-update", "2")) == 0
    last = save_dir / "checkpoint_last.pt"
    before = last.read_bytes()
    limit = len(before) // 2  # every new checkpoint is as large: its write fails half way

    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write() instead of a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    result = subprocess.run(train_command(*toy_args(save_dir, "--max-update", "4")), capture_output=True,
                            text=True, env=subprocess_env(), timeout=300, preexec_fn=limit_file_size)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"hetfair-train: error: File too large while writing {last}; the previous checkpoint is intact"]
    assert last.read_bytes() == before
    assert load_checkpoint(last)["trainer"]["num_updates"] == 2
    assert temp_files(save_dir) == []


@pytest.fixture
def previous(tmp_path: Path) -> Path:
    path = tmp_path / "checkpoint_last.pt"
    atomic_save({"format_version": 2, "trainer": {"weights": torch.arange(10.0)}}, path)
    return path


def _fail_fsync_with(exc: BaseException, monkeypatch: pytest.MonkeyPatch) -> None:
    def fsync(fd: int) -> None:
        raise exc

    monkeypatch.setattr(hetfair.checkpoint.os, "fsync", fsync)


def test_a_full_disk_says_so_and_keeps_the_previous_checkpoint(previous, monkeypatch):
    _fail_fsync_with(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), monkeypatch)
    with pytest.raises(CheckpointError) as caught:
        atomic_save({"format_version": 2, "trainer": {"weights": torch.zeros(10)}}, previous)
    assert str(caught.value) == f"no space left on device while writing {previous}; the previous checkpoint is intact"
    with pytest.raises(CheckpointError, match="no space left on device"):
        atomic_copy(previous, previous.parent / "checkpoint_best.pt")
    monkeypatch.undo()
    assert torch.equal(load_checkpoint(previous)["trainer"]["weights"], torch.arange(10.0))
    assert temp_files(previous.parent) == []


def test_ctrl_c_during_a_save_is_one_message_and_keeps_the_previous_checkpoint(previous, monkeypatch):
    _fail_fsync_with(KeyboardInterrupt(), monkeypatch)
    with pytest.raises(Interrupted) as caught:
        atomic_save({"format_version": 2, "trainer": {"weights": torch.zeros(10)}}, previous)
    assert str(caught.value) == f"interrupted while writing {previous}; the previous checkpoint is intact"
    assert caught.value.exit_code == 130
    monkeypatch.undo()
    assert torch.equal(load_checkpoint(previous)["trainer"]["weights"], torch.arange(10.0))
    assert temp_files(previous.parent) == []


def test_the_first_failed_save_says_that_no_checkpoint_was_written(tmp_path, monkeypatch):
    _fail_fsync_with(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), monkeypatch)
    with pytest.raises(CheckpointError, match="no checkpoint was written"):
        atomic_save({"trainer": {}}, tmp_path / "checkpoint_last.pt")
    assert list(tmp_path.iterdir()) == []


def test_temporary_files_of_killed_saves_are_removed_at_start_up(tmp_path):
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    stale = [save_dir / ".checkpoint_last.pt.k2j3h4.tmp", save_dir / ".checkpoint_3_300.pt.a8b9c0.tmp"]
    for path in stale:
        path.write_bytes(b"\0" * 4096)
    unrelated = save_dir / ".notes.tmp"
    unrelated.write_text("not ours")
    assert train_main(toy_args(save_dir, "--max-update", "1")) == 0
    assert temp_files(save_dir) == [".notes.tmp"]

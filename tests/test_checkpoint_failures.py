"""Saving can fail (full disk, file-size limit, Ctrl-C): one error line, the previous checkpoint intact,
no temporary file left behind; temporary files of killed runs are removed at start-up."""

from __future__ import annotations

import errno
import os
import resource
import signal
import subprocess
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

import hetfair.checkpoint.layout
from helpers import TOY_PLUGIN, subprocess_env, train_command
from hetfair.checkpoint.layout import CheckpointConfig, Checkpointer, atomic_copy, atomic_save, load_checkpoint
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
        f"hetfair-train: error: File too large while writing {last}; checkpoint_last.pt from update 2 is intact"]
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

    monkeypatch.setattr(hetfair.checkpoint.layout.os, "fsync", fsync)


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


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """``small_disk(n)``: a directory on a tmpfs of ``n`` bytes (a real full disk), unmounted afterwards."""
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        where = tmp_path / "small_disk"
        where.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs (needs root): {result.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", str(where)], check=True)


def test_a_full_disk_says_which_checkpoint_is_intact(tmp_path, small_disk, capsys):
    # a save that fails on a file that never existed (checkpoint_1_4.pt) must not say "no checkpoint was written"
    probe = tmp_path / "probe"
    assert train_main(toy_args(probe, "--max-update", "2", "--save-interval-updates", "2")) == 0
    pages = -(-(probe / "checkpoint_last.pt").stat().st_size // 4096)
    save_dir = small_disk((2 * pages + pages // 2) * 4096)  # room for two checkpoints, not for a third
    assert train_main(toy_args(save_dir, "--max-update", "4", "--save-interval-updates", "2")) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"hetfair-train: error: no space left on device while writing {save_dir / 'checkpoint_1_4.pt'}; "
        f"checkpoint_last.pt from update 2 is intact")
    assert load_checkpoint(save_dir / "checkpoint_last.pt")["trainer"]["num_updates"] == 2
    assert temp_files(save_dir) == []


class Updates:
    """The smallest trainer part: its update count."""

    def __init__(self) -> None:
        self.num_updates = 0

    def state_dict(self) -> dict[str, int]:
        return {"num_updates": self.num_updates}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.num_updates = state["num_updates"]


def test_a_save_that_fails_half_way_names_what_it_wrote_and_what_is_intact(tmp_path, monkeypatch):
    trainer = Updates()
    config = CheckpointConfig(tmp_path, save_interval_updates=2, no_epoch_checkpoints=True)
    checkpointer = Checkpointer(config, {"trainer": trainer}, {}, is_master=True)
    trainer.num_updates = 2
    checkpointer.save(epoch=1, num_updates=2, end_of_epoch=False, valid_metric=None)
    fsync = os.fsync

    def full_for_checkpoint_last(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path / ".checkpoint_last.pt.")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fsync(fd)

    monkeypatch.setattr(hetfair.checkpoint.layout.os, "fsync", full_for_checkpoint_last)
    trainer.num_updates = 4
    with pytest.raises(CheckpointError) as caught:
        checkpointer.save(epoch=1, num_updates=4, end_of_epoch=False, valid_metric=None)
    assert str(caught.value) == (f"no space left on device while writing {tmp_path / 'checkpoint_last.pt'}; "
                                 f"checkpoint_1_4.pt of update 4 is complete; checkpoint_last.pt from update 2 is intact")
    monkeypatch.undo()
    assert load_checkpoint(tmp_path / "checkpoint_last.pt")["trainer"]["num_updates"] == 2
    assert temp_files(tmp_path) == []


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

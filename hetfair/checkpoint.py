"""Checkpoints: atomic writes, safe loading, last/best/epoch/update files and pruning."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from hetfair.errors import CheckpointError, first_line

FORMAT_VERSION = 1


def atomic_save(state: dict[str, Any], path: Path) -> None:
    """Write ``state`` to a temporary file in the same directory, then rename it over ``path``.

    A crash at any point leaves either the old file or the new one, never a torn file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_copy(source: Path, target: Path) -> None:
    """Copy ``source`` to ``target`` through a temporary file and a rename."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        shutil.copyfile(source, tmp_name)
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True``; damage becomes a :class:`CheckpointError`."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise CheckpointError(f"checkpoint {path} is corrupt or not a hetfair checkpoint: {first_line(exc)}") from exc
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION or "trainer" not in state:
        raise CheckpointError(f"checkpoint {path} is not a hetfair checkpoint (format {FORMAT_VERSION})")
    return state



class CheckpointManager:
    """Decides which files to write after an epoch or update, writes them, prunes old ones."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.save_dir = Path(args.save_dir)
        self.best_metric: Optional[float] = None

    def restore_path(self) -> Path:
        path = Path(self.args.restore_file)
        return path if path.is_absolute() else self.save_dir / path

    def is_better(self, value: float) -> bool:
        if self.best_metric is None:
            return True
        return value > self.best_metric if self.args.maximize_best_checkpoint_metric else value < self.best_metric

    def file_names(self, epoch: int, num_updates: int, end_of_epoch: bool, valid_metric: Optional[float]) -> list[str]:
        """The checkpoint files this save should produce, most specific first."""
        args = self.args
        names = []
        if end_of_epoch and not args.no_epoch_checkpoints and epoch % args.save_interval == 0:
            names.append(f"checkpoint{epoch}.pt")
        if not end_of_epoch and args.save_interval_updates > 0 and num_updates % args.save_interval_updates == 0:
            names.append(f"checkpoint_{epoch}_{num_updates}.pt")
        if valid_metric is not None and self.is_better(valid_metric):
            names.append("checkpoint_best.pt")
        names.append("checkpoint_last.pt")
        return names

    def save(self, state: dict[str, Any], names: list[str], valid_metric: Optional[float]) -> None:
        """Write ``state`` once, copy it to the other names, then prune (master only)."""
        if valid_metric is not None and self.is_better(valid_metric):
            self.best_metric = valid_metric
        state = {**state, "format_version": FORMAT_VERSION, "best_metric": self.best_metric}
        first = self.save_dir / names[0]
        atomic_save(state, first)
        for name in names[1:]:
            atomic_copy(first, self.save_dir / name)
        self.prune()

    def prune(self) -> None:
        if self.args.keep_interval_updates >= 0:
            self._keep_newest(r"checkpoint_\d+_(\d+)\.pt", self.args.keep_interval_updates)
        if self.args.keep_last_epochs >= 0:
            self._keep_newest(r"checkpoint(\d+)\.pt", self.args.keep_last_epochs)

    def _keep_newest(self, pattern: str, keep: int) -> None:
        found = []
        for path in self.save_dir.iterdir():
            match = re.fullmatch(pattern, path.name)
            if match:
                found.append((int(match.group(1)), path))
        for _, path in sorted(found, reverse=True)[keep:]:
            path.unlink(missing_ok=True)

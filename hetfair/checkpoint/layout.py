"""The one owner of the checkpoint layout: composed from stateful parts, written atomically, loaded safely.

A checkpoint is one ``torch.save`` dict with these top-level keys (format 2)::

    format_version  2
    best_metric     best value so far of --best-checkpoint-metric (or None)
    config          the training options as plain data (numbers, strings, lists)
    trainer         model, optimizer (full, also when sharded; with --ddp-backend localsgd/diloco also every
                    rank's inner optimizer tensors and the outer optimizer, under outer_loop), optimizer_name,
                    lr_scheduler, num_updates
    position        epoch (1-based) and samples_done in it
    clock           wall_seconds of training so far, over all runs of the job
    epoch_stats     the running training statistics of the current epoch
    batch           global_batch_size and update_freq: the samples of each update, kept on resume
    balance         the load balancer's split and measurements (only with --auto-balance)
    plan            the per-device plan: world_size, backend, fractions, micro_batches and ranks (each rank's
                    device, memory, budget, precision, probed micro-batch, why); a resume says what changed
    loss_scale      the job's loss scale and its updates without overflow (only when a rank runs fp16)
    comm            the hook, the mode auto chose, and PowerSGD's state of every rank, by parameter: error
                    feedback, P/Q, step, generator (only with --ddp-comm-hook powersgd/auto on several processes)
    rng             Python, numpy and torch generator states

Each part but ``config`` and ``best_metric`` is the ``state_dict()`` of one stateful object
(:class:`Stateful`); :class:`Checkpointer` composes them, and nothing else knows this layout.
Parameters and optimizer state are fp32 whatever precision the ranks trained in, so a run
may resume in another precision; ``loss_scale`` is then used only if a rank runs fp16.
Older formats are migrated on load (:data:`MIGRATIONS`). Files are loaded with
``torch.load(weights_only=True)``, so a checkpoint cannot run code.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Mapping, Optional, Protocol

import torch

from hetfair.checkpoint.writer import CheckpointWriter, host_snapshot
from hetfair.errors import CheckpointError, ConfigError, Interrupted, first_line
from hetfair.utils import check_output_dir

FORMAT_VERSION = 2
TRAINER = "trainer"
DEFAULT_RESTORE_FILE = "checkpoint_last.pt"


class Stateful(Protocol):
    """A part of the training state that a checkpoint stores."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


def _v1_to_v2(state: dict[str, Any]) -> dict[str, Any]:
    """Format 1 kept wall time as a bare number, ``balance: None`` and per-rank stats under string keys."""
    state = dict(state)
    state["clock"] = {"wall_seconds": float(state.pop("wall", 0.0))}
    if state.get("balance") is None:
        state.pop("balance", None)
    stats = dict(state.get("epoch_stats") or {})
    per_rank = stats.pop("per_rank", {})
    stats.setdefault("samples", list(per_rank.get("samples", [])))
    stats.setdefault("compute_seconds", list(per_rank.get("compute_seconds", [])))
    state["epoch_stats"] = stats
    return state


MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {1: _v1_to_v2}
"""``MIGRATIONS[v]`` turns a format-``v`` checkpoint into format ``v + 1``."""


TEMP_SUFFIX = ".tmp"


OnDisk = Callable[[Path], str]
"""What a failed write left on disk, for its error line (given the path it failed to write)."""


def previous_file(path: Path) -> str:
    """The default account of a failed write of ``path``: whether an earlier version of it is intact."""
    return "the previous checkpoint is intact" if path.exists() else "no checkpoint was written"


def atomic_save(state: dict[str, Any], path: Path, on_disk: OnDisk = previous_file) -> None:
    """Write ``state`` to a temporary file in the same directory, then rename it over ``path``.

    A crash at any point leaves either the old file or the new one, never a torn file. A full
    disk or Ctrl-C while writing removes the temporary file and becomes one error that says
    what is on disk (``on_disk``: by default whether the previous ``path`` is intact).
    """
    def write(handle: BinaryIO) -> None:
        torch.save(state, handle)

    _write_atomically(path, write, on_disk)


def atomic_copy(source: Path, target: Path, on_disk: OnDisk = previous_file) -> None:
    """Copy ``source`` to ``target`` through a temporary file and a rename."""
    def write(handle: BinaryIO) -> None:
        with open(source, "rb") as original:
            shutil.copyfileobj(original, handle)

    _write_atomically(target, write, on_disk)


def _write_atomically(path: Path, write: Callable[[BinaryIO], None], on_disk: OnDisk) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException as exc:
        Path(tmp_name).unlink(missing_ok=True)
        intact = on_disk(path)
        if isinstance(exc, KeyboardInterrupt):
            raise Interrupted(f"interrupted while writing {path}; {intact}") from exc
        cause = _os_error(exc)
        if cause is None:
            raise
        what = "no space left on device" if cause.errno in (errno.ENOSPC, errno.EDQUOT) else cause.strerror
        raise CheckpointError(f"{what} while writing {path}; {intact}") from exc
    _fsync_dir(path.parent)


def _os_error(exc: BaseException) -> Optional[OSError]:
    """The operating-system error behind ``exc`` (torch.save wraps a failed write in a RuntimeError)."""
    seen: Optional[BaseException] = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def remove_stale_temp_files(directory: Path) -> list[Path]:
    """Delete the temporary files of saves that were killed before their rename; return them."""
    stale = [p for p in directory.glob(f".checkpoint*.pt.*{TEMP_SUFFIX}") if p.is_file()]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


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


def load_checkpoint(path: Path, mmap: bool = False) -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True`` and migrate it to the current format.

    With ``mmap`` its tensors are memory-mapped (read-only for the file: written pages are the
    process's own copies): a page is read when something reads it, so a sharded rank that keeps a
    slice of each tensor reads (and holds) that slice only. Only for a caller that copies what it
    keeps before the file can change: a tensor still mapped when the file is rewritten in place
    (``torch.save`` to the same path) kills the process with a bus error, so the default reads the
    file whole. Every checkpoint hetfair writes is a ``torch.save`` zip archive, the format ``mmap``
    needs, so checkpoints of earlier versions load as they did (and are migrated as below).

    Damage, a foreign file or a format from a newer hetfair becomes a :class:`CheckpointError`.
    """
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path} is not a hetfair checkpoint: not a torch.save archive (corrupt, truncated "
                              f"or another kind of file)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise CheckpointError(
            f"checkpoint {path} is corrupt or not a hetfair checkpoint: {_load_failure(exc)}") from exc
    version = state.get("format_version") if isinstance(state, dict) else None
    if not isinstance(version, int) or TRAINER not in state:
        raise CheckpointError(f"checkpoint {path} is not a hetfair checkpoint (format {FORMAT_VERSION})")
    if version > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format {version}, newer than this hetfair's "
                              f"{FORMAT_VERSION}; upgrade hetfair to read it")
    while version < FORMAT_VERSION:
        if version not in MIGRATIONS:
            raise CheckpointError(f"checkpoint {path} has format {version}, which this hetfair cannot read")
        state = {**MIGRATIONS[version](state), "format_version": version + 1}
        version += 1
    return state


def _load_failure(exc: BaseException) -> str:
    """Why ``torch.load(weights_only=True)`` failed, in one line.

    torch's weights-only refusal opens with paragraphs of advice; its cause (the
    Python object it would not unpickle) is on a later line.
    """
    cause = re.search(r"WeightsUnpickler error: (.*?)(?: Please use|\n|$)", str(exc))
    if cause:
        return (f"it holds Python objects beyond tensors and plain data ({cause.group(1).strip()}); "
                f"hetfair loads checkpoints with weights_only=True")
    return first_line(exc)


def stored_config(state: Mapping[str, Any]) -> dict[str, Any]:
    """The training options a checkpoint was written with (plain data)."""
    config = dict(state.get("config") or {})
    if "task" not in config:
        raise CheckpointError("checkpoint holds no training options; was it written by hetfair-train?")
    return config


def model_weights(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The model's ``state_dict`` inside a loaded checkpoint."""
    return state[TRAINER]["model"]


def progress_of(state: Mapping[str, Any]) -> tuple[int, int, int]:
    """How far the run of a checkpoint's state came: (epoch, samples done in it, updates)."""
    return int(state["position"]["epoch"]), int(state["position"]["samples_done"]), int(state[TRAINER]["num_updates"])


@dataclass(frozen=True)
class CheckpointConfig:
    """Where checkpoints go, which are written and kept (the ``--save-*``/``--keep-*`` flags)."""

    save_dir: Path
    restore_file: str = DEFAULT_RESTORE_FILE
    no_save: bool = False
    save_interval: int = 1
    save_interval_updates: int = 0
    keep_interval_updates: int = -1
    keep_last_epochs: int = -1
    no_epoch_checkpoints: bool = False
    maximize_best_checkpoint_metric: bool = False
    async_save: bool = False
    """Write in the background (see :mod:`hetfair.checkpoint.writer`); ``hetfair-train`` does unless
    given ``--no-async-save``."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "CheckpointConfig":
        return cls(Path(args.save_dir), args.restore_file, args.no_save, args.save_interval,
                   args.save_interval_updates, args.keep_interval_updates, args.keep_last_epochs,
                   args.no_epoch_checkpoints, args.maximize_best_checkpoint_metric, not args.no_async_save)

    def check_paths(self) -> None:
        """Fail at start-up when checkpoints could not be written or the named restore file is missing."""
        if not self.no_save:
            check_output_dir("--save-dir", self.save_dir)
        path = self.restore_path()
        if self.restore_file != DEFAULT_RESTORE_FILE and not path.is_file():
            raise ConfigError(f"--restore-file {path} does not exist")

    def restore_path(self) -> Path:
        path = Path(self.restore_file)
        return path if path.is_absolute() else self.save_dir / path

    def resumes(self) -> bool:
        """Whether the run resumes from :meth:`restore_path` (when it exists): always from a named
        ``--restore-file``, from the last checkpoint in ``--save-dir`` only when the run saves."""
        return self.restore_file != DEFAULT_RESTORE_FILE or not self.no_save


class Checkpointer:
    """Saves and restores the named stateful ``parts`` of a run; decides file names, prunes old files.

    ``save`` is a collective (a sharded optimizer's state is gathered to rank 0): every rank
    calls it, rank 0 writes, by default on a background thread from a host-memory snapshot
    (:meth:`check`, :meth:`wait` and :meth:`close` surface a failed write). ``options`` are
    stored as the checkpoint's ``config``.
    """

    def __init__(self, config: CheckpointConfig, parts: Mapping[str, Stateful], options: Mapping[str, Any],
                 is_master: bool) -> None:
        if TRAINER not in parts:
            raise ValueError(f"a checkpoint needs a '{TRAINER}' part")
        self.config = config
        self.parts = dict(parts)
        self.options = dict(options)
        self.is_master = is_master
        self.best_metric: Optional[float] = None
        self.last_saved_update: Optional[int] = None
        """The update of the ``checkpoint_last.pt`` in ``save_dir`` (written or resumed from by this run)."""
        self.writer = CheckpointWriter(background=config.async_save and is_master and not config.no_save)

    # -- saving ---------------------------------------------------------------
    def save(self, epoch: int, num_updates: int, end_of_epoch: bool, valid_metric: Optional[float]) -> None:
        """Write the files due after ``epoch`` / ``num_updates`` (nothing with ``--no-save``)."""
        if self.config.no_save:
            return
        state = {name: part.state_dict() for name, part in self.parts.items()}
        if not self.is_master:
            return
        names = self.file_names(epoch, num_updates, end_of_epoch, valid_metric)
        if valid_metric is not None and self.is_better(valid_metric):
            self.best_metric = valid_metric
        state.update(format_version=FORMAT_VERSION, best_metric=self.best_metric, config=self.options)
        if self.writer.background:
            state = host_snapshot(state)  # training goes on changing the tensors in place
        self.writer.submit(lambda: self._write(state, names))

    def _write(self, state: dict[str, Any], names: list[str]) -> None:
        first = self.config.save_dir / names[0]
        updates = state[TRAINER].get("num_updates")
        written: list[str] = []

        def on_disk(failed: Path) -> str:
            return self._on_disk(written, updates)

        atomic_save(state, first, on_disk)
        written.append(names[0])
        for name in names[1:]:
            atomic_copy(first, self.config.save_dir / name, on_disk)
            written.append(name)
        self.last_saved_update = updates
        self.prune()

    def _on_disk(self, written: list[str], updates: Optional[int]) -> str:
        """What a save that failed part way leaves: the files it wrote, and the ``checkpoint_last.pt`` to resume from."""
        parts = [f"{' and '.join(written)} of update {updates} {'is' if len(written) == 1 else 'are'} complete"
                 ] if written else []
        if (self.config.save_dir / DEFAULT_RESTORE_FILE).is_file():
            of_update = f" from update {self.last_saved_update}" if self.last_saved_update is not None else ""
            parts.append(f"{DEFAULT_RESTORE_FILE}{of_update} is intact")
        else:
            parts.append(f"there is no {DEFAULT_RESTORE_FILE} yet" if written else "no checkpoint was written")
        return "; ".join(parts)

    def check(self) -> None:
        """Raise the error of a background save that failed since the last call (never waits)."""
        self.writer.check()

    def wait(self) -> None:
        """Return when every save is on disk; raise the error of one that failed."""
        self.writer.wait()

    def close(self) -> None:
        """Like :meth:`wait`, then stop the background writer."""
        self.writer.close()

    def is_better(self, value: float) -> bool:
        if self.best_metric is None:
            return True
        return value > self.best_metric if self.config.maximize_best_checkpoint_metric else value < self.best_metric

    def file_names(self, epoch: int, num_updates: int, end_of_epoch: bool, valid_metric: Optional[float]) -> list[str]:
        """The checkpoint files this save should produce, most specific first."""
        config = self.config
        names = []
        if end_of_epoch and not config.no_epoch_checkpoints and epoch % config.save_interval == 0:
            names.append(f"checkpoint{epoch}.pt")
        if not end_of_epoch and config.save_interval_updates > 0 and num_updates % config.save_interval_updates == 0:
            names.append(f"checkpoint_{epoch}_{num_updates}.pt")
        if valid_metric is not None and self.is_better(valid_metric):
            names.append("checkpoint_best.pt")
        names.append("checkpoint_last.pt")
        return names

    def prune(self) -> None:
        if self.config.keep_interval_updates >= 0:
            self._keep_newest(r"checkpoint_\d+_(\d+)\.pt", self.config.keep_interval_updates)
        if self.config.keep_last_epochs >= 0:
            self._keep_newest(r"checkpoint(\d+)\.pt", self.config.keep_last_epochs)

    def _keep_newest(self, pattern: str, keep: int) -> None:
        found = []
        for path in self.config.save_dir.iterdir():
            match = re.fullmatch(pattern, path.name)
            if match:
                found.append((int(match.group(1)), path))
        for _, path in sorted(found, reverse=True)[keep:]:
            path.unlink(missing_ok=True)

    # -- restoring --------------------------------------------------------------
    def restore(self) -> Optional[Path]:
        """Load ``--restore-file`` into the parts; ``None`` when there is nothing to resume.

        A part the checkpoint lacks (e.g. ``balance`` of a run without ``--auto-balance``)
        keeps its fresh state.
        """
        if not self.config.resumes():
            return None
        if self.is_master and self.config.save_dir.is_dir():
            remove_stale_temp_files(self.config.save_dir)
        path = self.config.restore_path()
        if not path.is_file():
            if self.config.restore_file != DEFAULT_RESTORE_FILE:
                raise ConfigError(f"--restore-file {path} does not exist")
            return None
        state = load_checkpoint(path, mmap=True)  # hetfair replaces checkpoints by renames, never in place
        try:
            self.load(state)
        except CheckpointError as exc:
            raise CheckpointError(f"cannot resume from {self._describe_restore(path)}: {exc}"
                                  f"{self._arch_note(state)}; {self._fresh_start_hint(path)}") from exc
        if path == self.config.save_dir / DEFAULT_RESTORE_FILE:
            self.last_saved_update = state[TRAINER].get("num_updates")
        return path

    def state(self) -> dict[str, Any]:
        """Every part's state and the best metric, in memory: what live recovery hands from rank to rank
        (local on every rank where the optimizer state is not sharded)."""
        return {**{name: part.state_dict() for name, part in self.parts.items()}, "best_metric": self.best_metric}

    def load(self, state: Mapping[str, Any]) -> None:
        """Load a checkpoint's (or :meth:`state`'s) parts; a part it lacks keeps its fresh state."""
        for name, part in self.parts.items():
            if name in state:
                part.load_state_dict(state[name])
        self.best_metric = state.get("best_metric")

    def _describe_restore(self, path: Path) -> str:
        if self.config.restore_file == DEFAULT_RESTORE_FILE:
            return f"{path} (resumed automatically: it is the last checkpoint in --save-dir {self.config.save_dir})"
        return f"--restore-file {path}"

    def _arch_note(self, state: Mapping[str, Any]) -> str:
        """Which ``--arch`` wrote the checkpoint, when it is not this run's."""
        written_with, now = (state.get("config") or {}).get("arch"), self.options.get("arch")
        return f" (it was written with --arch {written_with}, this run has --arch {now})" if written_with != now else ""

    def _fresh_start_hint(self, path: Path) -> str:
        if self.config.restore_file == DEFAULT_RESTORE_FILE:
            return f"to start afresh, pass another --save-dir (or move {path} away)"
        return "pass a --restore-file that this run's options fit"

"""Progress output on the master rank: tqdm bar, plain lines, JSON lines or nothing.

Numbers follow one convention everywhere hetfair prints them (training progress and
``hetfair-validate``), fairseq's: every metric is rounded to a fixed number of
decimals of its own (:data:`DECIMALS`, 3 for metrics not listed), counts print as
integers and the learning rate with 4 significant digits. So a loss reads ``1.000``,
never ``1``, and the same metric has the same width in every line.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from contextlib import contextmanager
from typing import Callable, Iterator, Mapping, Optional, TextIO

from tqdm import tqdm

DECIMALS: dict[str, int] = {
    "ppl": 2,
    "accuracy": 2,
    "clip": 1,
    "ups": 2,
    "wps": 1,
    "bsz": 1,
    "share": 1,
    "sps": 1,
    "wall": 0,
}
"""Decimals per metric (a trailing rank number is ignored: ``share3`` is ``share``); others get 3."""

BAR_POSTFIX = ("loss",)
"""The metrics the tqdm bar shows beside itself, of the updates since the last ``train_inner`` line
(printed in full above it)."""


def _decimals(name: str) -> int:
    base = re.sub(r"\d+$", "", name)
    if base in DECIMALS:
        return DECIMALS[base]
    return DECIMALS["accuracy"] if base.endswith("accuracy") else 3


def format_metric(name: str, value: float) -> str:
    """``value`` of metric ``name`` as hetfair prints it (see the module docstring)."""
    if isinstance(value, bool) or isinstance(value, int):
        return str(int(value))
    if name == "lr":
        return f"{value:.4g}"
    return f"{value:.{_decimals(name)}f}"


def format_metrics(metrics: Mapping[str, float]) -> str:
    """``name value | name value ...`` in the common number format."""
    return " | ".join(f"{name} {format_metric(name, value)}" for name, value in metrics.items())


class Progress:
    """Writes training and validation metrics in the chosen ``--log-format``."""

    def __init__(self, log_format: Optional[str], enabled: bool, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        if log_format is None:
            log_format = "tqdm" if self.stream.isatty() else "simple"
        self.format = log_format if enabled else "none"
        self._bar: Optional[tqdm] = None

    def start_epoch(self, epoch: int, total_steps: int, start_step: int) -> None:
        if self.format == "tqdm":
            self._bar = tqdm(total=total_steps, initial=start_step, desc=f"epoch {epoch:03d}",
                             file=self.stream, leave=False, dynamic_ncols=True)

    def step(self, steps: int = 1, metrics: Optional[Callable[[], Mapping[str, float]]] = None) -> None:
        """Move the bar on by ``steps``; beside it go the :data:`BAR_POSTFIX` entries of ``metrics()``
        (called only when a bar is shown)."""
        if self._bar is None:
            return
        if metrics is not None:
            current = metrics()
            self._bar.set_postfix({k: format_metric(k, current[k]) for k in BAR_POSTFIX if k in current},
                                  refresh=False)
        self._bar.update(steps)

    def end_epoch(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def log(self, phase: str, metrics: dict[str, float], epoch: int, num_updates: int) -> None:
        """Report ``metrics`` of ``phase`` (``train``, ``train_inner``, ``valid`` ...)."""
        if self.format == "none" or not metrics:
            return
        if self.format == "json":
            record = {"phase": phase, "epoch": epoch, "num_updates": num_updates, **metrics}
            self._write(json.dumps(record, sort_keys=False))
            return
        self._write(f"{phase} | epoch {epoch:03d} | num_updates {num_updates} | {format_metrics(metrics)}")

    def info(self, line: str) -> None:
        """A free-form line (start-up summary, notices), unless output is off."""
        if self.format != "none":
            self._write(line)

    @contextmanager
    def showing_log_records(self, level: int = logging.INFO) -> Iterator[None]:
        """Show Python ``logging`` records of ``level`` and above as lines of this output, meanwhile.

        Plugins say things (e.g. which data they use) with ``logging.getLogger(__name__).info``;
        this prints them on the master without breaking the tqdm bar. Other processes keep
        Python's default: warnings and errors only.
        """
        if self.format == "none":
            yield
            return
        root = logging.getLogger()
        handler = _ProgressHandler(self)
        old_level = root.level
        root.addHandler(handler)
        if root.getEffectiveLevel() > level:
            root.setLevel(level)
        try:
            yield
        finally:
            root.removeHandler(handler)
            root.setLevel(old_level)

    def _write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)


class _ProgressHandler(logging.Handler):
    """Hands log records to a :class:`Progress` as plain lines."""

    def __init__(self, progress: Progress) -> None:
        super().__init__()
        self.progress = progress

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.progress.info(self.format(record))
        except Exception:  # noqa: BLE001 - logging must never break training
            self.handleError(record)

"""Progress output on the master rank: tqdm bar, plain lines, JSON lines or nothing."""

from __future__ import annotations

import json
import sys
from typing import Optional, TextIO

from tqdm import tqdm


def _format_value(value: float) -> str:
    if isinstance(value, int) or float(value).is_integer() and abs(value) < 1e9:
        return str(int(value))
    return f"{value:.4g}" if abs(value) < 1e-2 else f"{value:.3f}"


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

    def step(self, steps: int = 1) -> None:
        if self._bar is not None:
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
        elif self.format == "tqdm" and self._bar is not None and phase == "train_inner":
            self._bar.set_postfix({k: _format_value(v) for k, v in metrics.items()}, refresh=True)
        else:
            fields = " | ".join(f"{k} {_format_value(v)}" for k, v in metrics.items())
            self._write(f"{phase} | epoch {epoch:03d} | num_updates {num_updates} | {fields}")

    def info(self, line: str) -> None:
        """A free-form line (start-up summary), unless output is off."""
        if self.format != "none":
            self._write(line)

    def _write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

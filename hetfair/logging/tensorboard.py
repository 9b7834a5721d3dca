"""TensorBoard scalars, one run directory per phase (``train``, ``valid`` ...), and a custom-scalars layout.

``tensorboard`` is imported only when the first scalar is written, so runs
without ``--tensorboard-logdir`` never pay for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

HETEROGENEITY_LAYOUT: dict[str, dict[str, list]] = {
    "heterogeneity": {
        "share{r}: percent of the samples rank r processed": ["Multiline", [r"^share\d+$"]],
        "sps{r}: samples per second of rank r's compute": ["Multiline", [r"^sps\d+$"]],
        "balance_eff: 1 when all ranks finish each update together": ["Multiline", [r"^balance_eff$"]],
    }
}
"""TensorBoard's CUSTOM SCALARS tab: every rank's share on one chart, every rank's speed on another."""


class TensorBoardLogger:
    """Writes each phase's metrics to ``LOGDIR/PHASE`` at the update count (master only)."""

    def __init__(self, logdir: Optional[str], enabled: bool) -> None:
        self.logdir = Path(logdir) if logdir and enabled else None
        self._writers: dict[str, SummaryWriter] = {}

    def log(self, phase: str, metrics: dict[str, float], step: int) -> None:
        if self.logdir is None:
            return
        writer = self._writers.get(phase) or self._open(phase)
        for key, value in metrics.items():
            writer.add_scalar(key, value, step)
        writer.flush()

    def _open(self, phase: str) -> SummaryWriter:
        from torch.utils.tensorboard import SummaryWriter

        assert self.logdir is not None
        writer = self._writers[phase] = SummaryWriter(str(self.logdir / phase))
        if len(self._writers) == 1:  # the layout is read from any run of the logdir: write it once
            writer.add_custom_scalars(HETEROGENEITY_LAYOUT)
        return writer

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()

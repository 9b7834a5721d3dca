"""TensorBoard scalars, one run directory per phase (``train``, ``valid`` ...).

``tensorboard`` is imported only when the first scalar is written, so runs
without ``--tensorboard-logdir`` never pay for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter


class TensorBoardLogger:
    """Writes each phase's metrics to ``LOGDIR/PHASE`` at the update count (master only)."""

    def __init__(self, logdir: Optional[str], enabled: bool) -> None:
        self.logdir = Path(logdir) if logdir and enabled else None
        self._writers: dict[str, SummaryWriter] = {}

    def log(self, phase: str, metrics: dict[str, float], step: int) -> None:
        if self.logdir is None:
            return
        writer = self._writers.get(phase)
        if writer is None:
            from torch.utils.tensorboard import SummaryWriter

            writer = self._writers[phase] = SummaryWriter(str(self.logdir / phase))
        for key, value in metrics.items():
            writer.add_scalar(key, value, step)
        writer.flush()

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()

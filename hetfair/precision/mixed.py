"""Mixed precision: each process picks its own, the job shares one dynamic loss scale.

Each process runs its forward pass and loss in its own precision (``fp32``,
``bf16`` or ``fp16``) under :func:`autocast`; parameters, gradients and optimizer
state stay fp32, so the gradient all-reduce (DDP, ZeRO) is the same as without.

fp16's narrow range needs loss scaling, and an update must not depend on which
rank ran which precision. So there is one scale ``S`` for the whole job: when any
rank runs fp16 (the ranks agree at start-up, :func:`job_loss_scaler`), every rank
multiplies its summed loss by ``S`` before backward, the all-reduced gradient is
``S`` times the true one everywhere, and the trainer divides by ``S`` in the same
fused op that applies ``world_size / total_sample_size`` and looks for inf/NaN.
Every rank holds the same reduced gradients, so all see an overflow together,
skip the same update and change ``S`` the same way (:class:`LossScaler`) with no
extra collective. The ranks check at start-up that they were given the same loss-scaling
flags (:mod:`hetfair.run.startup`, with :meth:`LossScaleConfig.shared_settings`).
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ContextManager, Optional

import torch

from hetfair.errors import DivergenceError

PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parse_precision(text: str) -> str:
    """One ``--precision`` item, checked (a :class:`ValueError` names the choices)."""
    if text not in PRECISIONS:
        raise ValueError(f"'{text}' is not a precision; choose from {', '.join(PRECISIONS)}")
    return text


def autocast(precision: str, device: torch.device) -> ContextManager[Any]:
    """The context a forward pass and loss run in: autocast to bf16/fp16, nothing for fp32."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=_AUTOCAST_DTYPES[precision])


@dataclass(frozen=True)
class LossScaleConfig:
    """fairseq's loss-scaling flags (``--fp16-scale-tolerance`` is 0: every overflow lowers the scale)."""

    init_scale: float = 2.0**7
    """``--fp16-init-scale``: the scale of the first update."""
    scale_window: int = 2000
    """``--fp16-scale-window``: updates without overflow after which the scale doubles."""
    min_loss_scale: float = 1e-4
    """``--min-loss-scale``: an overflow that would take the scale to this or below stops training."""
    threshold_loss_scale: Optional[float] = None
    """``--threshold-loss-scale``: an overflow never lowers the scale below this."""

    @classmethod
    def from_args(cls, args: argparse.Namespace, world_size: int) -> "LossScaleConfig":
        """The flags of ``args``; the window defaults to fairseq's ``2**14 / world_size / update_freq``."""
        window = args.fp16_scale_window or max(1, int(2**14 / world_size / (args.update_freq or 1)))
        return cls(args.fp16_init_scale, window, args.min_loss_scale, args.threshold_loss_scale)

    def shared_settings(self) -> dict[str, float | None]:
        """The flags every rank must be given alike (the job shares one scale), by flag."""
        return {"--fp16-init-scale": self.init_scale, "--fp16-scale-window": self.scale_window,
                "--min-loss-scale": self.min_loss_scale, "--threshold-loss-scale": self.threshold_loss_scale}


class LossScaler:
    """The job's dynamic loss scale: halved on overflow, doubled after ``scale_window`` clean updates.

    Its state is identical on every rank because every rank feeds it the same
    overflow decisions; it is saved in checkpoints and restored exactly.
    """

    def __init__(self, config: LossScaleConfig) -> None:
        self.config = config
        self.scale = config.init_scale
        self.clean_updates = 0
        """Updates without overflow since the scale last changed."""

    def update(self, overflow: bool) -> None:
        """Account for one update; an overflow that would reach ``min_loss_scale`` raises :class:`DivergenceError`."""
        config = self.config
        if not overflow:
            self.clean_updates += 1
            if self.clean_updates >= config.scale_window:
                self.scale *= 2.0
                self.clean_updates = 0
            return
        lowered = self.scale / 2.0
        if config.threshold_loss_scale is not None:
            lowered = max(lowered, config.threshold_loss_scale)
        if lowered <= config.min_loss_scale:
            raise DivergenceError(
                f"gradients overflow even at loss scale {self.scale:g}, and halving it would take it to or below "
                f"--min-loss-scale {config.min_loss_scale:g}; the loss is probably exploding: lower --lr or set "
                f"--clip-norm"
            )
        self.scale = lowered
        self.clean_updates = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean_updates": self.clean_updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_updates = int(state["clean_updates"])


def job_loss_scaler(precisions: list[str], config: LossScaleConfig) -> Optional[LossScaler]:
    """The job's loss scaler when any rank runs fp16 (``precisions``: every rank's), else ``None``."""
    return LossScaler(config) if "fp16" in precisions else None

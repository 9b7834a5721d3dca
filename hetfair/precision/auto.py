"""``--precision auto``: the fastest precision this process's device trains in."""

from __future__ import annotations

import torch

from hetfair.plan import AUTO


def device_precision(device: torch.device) -> str:
    """bf16 on a CUDA device that supports it, fp16 (with the job's loss scale) on one that does not, fp32 on CPU."""
    if device.type != "cuda":
        return "fp32"
    return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"


def resolved_precision(precision: str, device: torch.device) -> str:
    """``precision`` as given, or the device's own for ``auto``."""
    return device_precision(device) if precision == AUTO else precision

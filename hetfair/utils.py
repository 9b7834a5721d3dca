"""Small helpers shared by the trainer and the training loop."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hetfair.errors import ConfigError


def move_to_device(sample: Any, device: torch.device) -> Any:
    """Recursively move the tensors of a batch to ``device``."""
    if isinstance(sample, torch.Tensor):
        return sample.to(device, non_blocking=True)
    if isinstance(sample, dict):
        return {key: move_to_device(value, device) for key, value in sample.items()}
    if isinstance(sample, (list, tuple)):
        return type(sample)(move_to_device(value, device) for value in sample)
    return sample


def derived_seed(*parts: int) -> int:
    """A 63-bit seed that depends on every part (e.g. seed, update, micro-batch, rank)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, dtype=np.uint32).view(np.uint64)[0]
               >> np.uint64(1))


def absolute_path(text: str) -> str:
    """An argparse ``type`` for paths: stored absolute, so a checkpoint's options work from any directory."""
    return os.path.abspath(os.path.expanduser(text))


def check_output_dir(flag: str, path: str | Path) -> None:
    """Fail now, not after an epoch, when ``path`` cannot be (created and) written as a directory."""
    target = Path(path).expanduser()
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "is not a directory" if existing == target else f"cannot be created: {existing} is not a directory"
        raise ConfigError(f"{flag} {path} {where}")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "is not writable" if existing == target else f"cannot be created: {existing} is not writable"
        raise ConfigError(f"{flag} {path} {where}")

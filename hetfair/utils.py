"""Small helpers shared across hetfair: batches to devices, seeds, state-dict checks, help text."""

from __future__ import annotations

import argparse
import hashlib
import os
import struct
from pathlib import Path
from typing import Any, Mapping

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
    """A 63-bit seed that depends on every part (e.g. seed, update, micro-batch, rank).

    BLAKE2b of the parts as signed 64-bit integers: about 1 us, against 15 us for
    numpy's ``SeedSequence``, and it runs once per micro-batch.
    """
    digest = hashlib.blake2b(struct.pack(f"<{len(parts)}q", *parts), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def state_dict_mismatch(model_state: Mapping[str, Any], loaded: Mapping[str, Any], shown: int = 3) -> str:
    """Why ``loaded`` does not fit a model whose ``state_dict()`` is ``model_state``, in one line.

    Counts of missing keys, unexpected keys and keys of another shape, each with
    its first ``shown`` names (shapes for the last kind); empty when they fit.
    """
    missing = [key for key in model_state if key not in loaded]
    unexpected = [key for key in loaded if key not in model_state]
    reshaped = [
        f"{key} ({_shape(loaded[key])} in the checkpoint, {_shape(model_state[key])} in the model)"
        for key in model_state
        if key in loaded and _shape(loaded[key]) != _shape(model_state[key])
    ]
    parts = []
    for what, keys in (("missing", missing), ("unexpected", unexpected), ("of another shape", reshaped)):
        if keys:
            more = f", ... ({len(keys) - shown} more)" if len(keys) > shown else ""
            parts.append(f"{len(keys)} key{'s' if len(keys) > 1 else ''} {what}: {', '.join(keys[:shown])}{more}")
    return "; ".join(parts)


def _shape(value: Any) -> str:
    return "x".join(map(str, value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """``--help`` with each option's default, ``(default: 0.001)``, after its description.

    Left out where there is nothing to show (no default, a flag that is off) and
    where the description already speaks of its default.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or default is None or default is False or default == argparse.SUPPRESS
                or "default" in text or action.help == argparse.SUPPRESS):
            return action.help
        return f"{text} (default: %(default)s)".strip()


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

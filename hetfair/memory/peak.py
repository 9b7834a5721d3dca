"""A process's peak memory since the last reset: the device's allocator on CUDA, the resident set on CPU.

On CPU the peak is the kernel's high-water mark of the resident set (``VmHWM`` in
``/proc/self/status``), reset by writing ``5`` to ``/proc/self/clear_refs`` (Linux); it counts
everything the process holds (the interpreter, torch, data), not only tensors.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def reset_peak(device: torch.device) -> None:
    """Start measuring the peak afresh (on CPU: the resident set's high-water mark falls to the current set)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        _CLEAR_REFS.write_text("5")


def peak_bytes(device: torch.device) -> int:
    """The peak memory since the last :func:`reset_peak`: bytes allocated on a CUDA device, resident on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _status_kib("VmHWM") * 1024


def current_bytes(device: torch.device) -> int:
    """The memory held now: bytes allocated on a CUDA device, the resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return _status_kib("VmRSS") * 1024


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{_STATUS} has no {field} line: peak memory on CPU needs Linux")
    return int(match.group(1))

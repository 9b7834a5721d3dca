"""Byte sizes as users write them: ``6G``, ``512M``, ``1.5GiB``, ``2000000``."""

from __future__ import annotations

import re

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"6G"`` -> 6 GiB in bytes (K, M, G, T are powers of 1024; a plain number is bytes).

    Raises :class:`ValueError` with a message naming the text for anything else.
    """
    match = _SIZE.match(text)
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"'{text}' is not a memory size (write it like 6G, 512M or 1.5GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def format_size(size: float) -> str:
    """A byte count for people: ``6442450944`` -> ``6.0G``."""
    for unit in ("T", "G", "M", "K"):
        if abs(size) >= _UNITS[unit]:
            return f"{size / _UNITS[unit]:.1f}{unit}"
    return f"{int(size)}B"

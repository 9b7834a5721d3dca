"""Ranks and the master address from SLURM's environment variables."""

from __future__ import annotations

import re
from typing import Mapping


def first_host(nodelist: str) -> str:
    """First host name of a SLURM node list such as ``gpu[03-05,09],cpu01``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot read SLURM node list '{nodelist}'")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def in_slurm_job(env: Mapping[str, str]) -> bool:
    return "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_JOB_NODELIST" in env

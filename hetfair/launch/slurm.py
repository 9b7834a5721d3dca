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


def tasks_on_this_node(env: Mapping[str, str]) -> int:
    """How many tasks of the job run on this node (0: SLURM does not say).

    From ``SLURM_TASKS_PER_NODE`` (``"4(x2),3"``: 4 on each of the first two nodes, 3 on
    the third) at this node's ``SLURM_NODEID``, else ``SLURM_NTASKS_PER_NODE``.
    """
    counts: list[int] = []
    for part in env.get("SLURM_TASKS_PER_NODE", "").split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            counts = []
            break
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    node = int(env.get("SLURM_NODEID", "0"))
    if node < len(counts):
        return counts[node]
    return int(env.get("SLURM_NTASKS_PER_NODE", "0") or 0)


def node_of(env: Mapping[str, str]) -> tuple[int, int] | None:
    """``(SLURM_NODEID, number of nodes)`` of a task of a SLURM job, else ``None``."""
    if not in_slurm_job(env):
        return None
    return int(env.get("SLURM_NODEID", "0")), int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "1")))

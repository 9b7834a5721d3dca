"""Per-rank memory budgets and the shard fractions they give."""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def fractions_from_budgets(budgets: Sequence[float]) -> tuple[float, ...]:
    """Each rank's share of the sharded state, in proportion to its budget (they sum to 1)."""
    total = float(sum(budgets))
    return tuple(float(budget) / total for budget in budgets)


def device_budget(device: torch.device) -> Optional[int]:
    """The default budget of a process: a CUDA device's free memory; ``None`` on CPU (no limit is known)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)

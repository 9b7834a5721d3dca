"""Who this process is in the job: rank, world size, device."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DistributedContext:
    """Rank, world size and device of one training process.

    ``world_size == 1`` means no process group exists and collectives are skipped.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

"""Small collectives used at start-up."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hetfair.distributed.context import DistributedContext


def all_gather_ints(context: DistributedContext, value: int) -> list[int]:
    """Every rank's ``value``, indexed by rank."""
    if not context.is_distributed:
        return [int(value)]
    local = torch.tensor([int(value)], dtype=torch.int64, device=comm_device(context))
    gathered = [torch.zeros_like(local) for _ in range(context.world_size)]
    dist.all_gather(gathered, local)
    return [int(t.item()) for t in gathered]


def comm_device(context: DistributedContext) -> torch.device:
    """Where collective buffers must live: the GPU for NCCL, the CPU for gloo."""
    return context.device if dist.get_backend() == "nccl" else torch.device("cpu")

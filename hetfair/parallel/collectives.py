"""Small collectives: integers at start-up, JSON data for statistics that cannot be summed.

Nothing here unpickles what a peer sends: data travels as tensors (JSON text in a byte
tensor), so a rank never runs code chosen by another process.
"""

from __future__ import annotations

import json
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from hetfair.parallel.context import DistributedContext
from hetfair.errors import ConfigError


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


def all_gather_json(context: DistributedContext, value: Any) -> list[Any]:
    """Every rank's ``value`` (JSON data: numbers, strings, lists, dicts, None), indexed by rank."""
    if not context.is_distributed:
        return [value]
    try:
        payload = json.dumps(value).encode()
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"a logged value cannot be sent to the other ranks: {exc}; log numbers, strings or "
                          f"lists of them") from exc
    sizes = all_gather_ints(context, len(payload))
    local = torch.zeros(max(sizes), dtype=torch.uint8, device=comm_device(context))
    local[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    gathered = [torch.empty_like(local) for _ in range(context.world_size)]
    dist.all_gather(gathered, local)
    return [json.loads(bytes(t[:size].cpu().tolist())) for t, size in zip(gathered, sizes)]


def timed_all_reduce(context: DistributedContext, numbers: int, group: Optional[dist.ProcessGroup] = None) -> float:
    """Seconds one all-reduce of ``numbers`` fp32 values over ``group`` (default: every rank) takes, the slowest
    rank's (the same number on every rank of the group). A small all-reduce first lines the ranks up, so no rank's
    clock counts another's start-up."""
    device = comm_device(context)
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    buffer = torch.zeros(numbers, device=device)
    start = _now(device)
    dist.all_reduce(buffer, group=group)
    seconds = torch.tensor([_now(device) - start], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
    return float(seconds.item())


def _now(device: torch.device) -> float:
    """The clock, once ``device``'s queued work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()

"""Optimizer-state sharding (ZeRO stage 1), with shard sizes that can follow the hardware.

With ``--zero-sharding os`` the chosen ``torch.optim`` class runs inside torch's
:class:`~torch.distributed.optim.ZeroRedundancyOptimizer`: each rank keeps the
optimizer state of its own shard of the parameters, steps that shard and
broadcasts it to the others. Gradients stay full on every rank (DDP), so the
trainer's normalisation and global-norm clipping are unchanged. Checkpoints hold
the plain optimizer's ``state_dict`` (gathered on rank 0), so they load with or
without sharding and on any world size.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import TYPE_CHECKING, Any, Optional

import torch

from hetfair.parallel.collectives import all_gather_ints
from hetfair.parallel.context import DistributedContext
from hetfair.errors import ConfigError

if TYPE_CHECKING:
    from hetfair.optim import HetfairOptimizer


def build_sharded_optimizer(
    recipe: type["HetfairOptimizer"],
    args: argparse.Namespace,
    params: list[torch.nn.Parameter],
    shard_weights: Optional[str],
    world_size: int,
) -> torch.optim.Optimizer:
    """``recipe``'s optimizer over ``params`` (its flags in ``args``), its state sharded across the ranks
    (in proportion to ``--zero-shard-weights`` when given)."""
    weights = parse_shard_weights(shard_weights, world_size) if shard_weights else None
    from hetfair.parallel.zero_optimizer import ShardedOptimizer  # torch.distributed.optim costs 0.65 s to import

    return ShardedOptimizer(params, recipe.torch_class, weights, **recipe.build_kwargs(args, params))


def parse_shard_weights(text: str, world_size: Optional[int] = None) -> list[float]:
    """``--zero-shard-weights`` as positive weights, one per rank (the count is checked when given)."""
    try:
        weights = [float(value) for value in text.split(",")]
    except ValueError:
        raise ConfigError(f"--zero-shard-weights must be numbers like '1,1,2', got '{text}'") from None
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise ConfigError(f"--zero-shard-weights must all be positive numbers, got '{text}'")
    if world_size is not None and len(weights) != world_size:
        raise ConfigError(
            f"--zero-shard-weights has {len(weights)} weights but there are {world_size} ranks; give one per rank"
        )
    return weights


def weight_share(shard_weights: Optional[str], rank: int, world_size: int) -> float:
    """``rank``'s nominal share of the optimizer state (its weight over their sum; equal without weights).
    Parameters are whole, so the shard each rank gets is only close to it."""
    weights = parse_shard_weights(shard_weights, world_size) if shard_weights else [1.0] * world_size
    return weights[rank] / sum(weights)


def check_sharding(zero_sharding: str, zero_shard_weights: Optional[str], world_size: int) -> None:
    """What can be checked once the world size is known, before any process starts."""
    if zero_sharding == "none":
        return
    if world_size < 2:
        raise ConfigError("--zero-sharding os needs more than one process (--distributed-world-size N)")
    if zero_shard_weights:
        parse_shard_weights(zero_shard_weights, world_size)


def is_sharded(optimizer: torch.optim.Optimizer) -> bool:
    """True for a ZeroRedundancyOptimizer (checked without importing it when nothing built one)."""
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer-state tensors this rank holds."""
    local = optimizer.optim if is_sharded(optimizer) else optimizer
    return sum(
        value.numel() * value.element_size()
        for state in local.state.values()
        for value in state.values()
        if torch.is_tensor(value)
    )


def full_state_dict(optimizer: torch.optim.Optimizer, context: DistributedContext) -> Optional[dict[str, Any]]:
    """The plain optimizer's ``state_dict``; when sharded a collective that returns it on rank 0 only."""
    if not is_sharded(optimizer):
        return optimizer.state_dict()
    optimizer.consolidate_state_dict(to=0)
    return optimizer.state_dict() if context.is_master else None


def shard_report(optimizer: torch.optim.Optimizer, context: DistributedContext) -> dict[str, float]:
    """Per-rank ``params{r}`` and ``state_bytes{r}`` when sharded (a collective), else ``{}``."""
    if not is_sharded(optimizer):
        return {}
    state_bytes = all_gather_ints(context, optimizer_state_bytes(optimizer))
    report: dict[str, float] = {}
    for rank, (numel, size) in enumerate(zip(optimizer.shard_numels(), state_bytes)):
        report[f"params{rank}"] = numel
        report[f"state_bytes{rank}"] = size
    return report

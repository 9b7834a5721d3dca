"""The ZeroRedundancyOptimizer subclass behind ``--zero-sharding os`` (imported only when used)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer


def weighted_partition(params: Sequence[torch.Tensor], weights: Sequence[float]) -> list[list[torch.Tensor]]:
    """Split ``params`` so that rank ``r`` holds about ``weights[r] / sum(weights)`` of the elements.

    Greedy, largest parameter first, onto the rank whose load / weight would stay
    smallest; with equal weights this is ZeroRedundancyOptimizer's own partition.
    Parameters are never split, so shares are only as fine as the parameters.
    """
    loads = [0] * len(weights)
    shards: list[list[torch.Tensor]] = [[] for _ in weights]
    for param in sorted(params, key=lambda p: p.numel(), reverse=True):
        rank = min(range(len(weights)), key=lambda r: (loads[r] + param.numel()) / weights[r])
        shards[rank].append(param)
        loads[rank] += param.numel()
    return shards


class ShardedOptimizer(ZeroRedundancyOptimizer):
    """ZeroRedundancyOptimizer with weighted shards, plain-format loading and no stray copies.

    This class is the only place hetfair touches ZeroRedundancyOptimizer
    internals (torch 2.x): ``_partition_parameters`` accepts an explicit
    partition (one parameter group only) but has no public hook, and
    ``_all_state_dicts`` holds the states gathered by ``consolidate_state_dict``.
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        optimizer_class: type[torch.optim.Optimizer],
        shard_weights: Optional[list[float]],
        **defaults: Any,
    ) -> None:
        self.shard_weights = shard_weights  # set first: the base constructor partitions
        super().__init__(params, optimizer_class=optimizer_class, **defaults)

    def _partition_parameters(self, params_per_rank: Optional[list[list[torch.Tensor]]] = None) -> list[list[dict]]:
        # Called lazily and repeatedly; an explicit partition is only accepted while nothing is cached.
        if params_per_rank is None and self.shard_weights is not None and not self._partition_parameters_cache:
            params_per_rank = weighted_partition(self.param_groups[0]["params"], self.shard_weights)
        return super()._partition_parameters(params_per_rank)

    def shard_numels(self) -> list[int]:
        """Number of parameter elements each rank updates (and keeps optimizer state for)."""
        return [sum(p.numel() for group in groups for p in group["params"]) for groups in self._partition_parameters()]

    def state_dict(self) -> dict[str, Any]:
        """The full, plain-format state after :meth:`consolidate_state_dict` (on the receiving rank)."""
        try:
            return super().state_dict()
        finally:
            self._all_state_dicts = []  # else the receiving rank keeps a full copy until the next save

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full, plain-format state (any world size); this rank keeps only its shard."""
        super().load_state_dict({**state_dict, "state": dict(state_dict["state"])})  # torch overwrites entries
        # torch's base class also stored a second copy of this rank's shard; the local optimizer owns it
        self.state.clear()

"""``--ddp-backend hybrid_sharded``: shard inside each node, replicate across nodes (FSDP2 on a 2-D mesh).

Over slow links between nodes, sharding over every rank sends each gradient's
reduce-scatter and each parameter's all-gather across them. Here a unit is sharded
over the ranks of one node only (their links are fast) and replicated over the nodes:
its gradient is reduce-scattered inside the node, and one all-reduce of the shard
crosses the slow link (torch's hybrid sharding, ``fully_shard(..., mesh=2-D)``). The
update, the clipping norm, the overflow agreement and the portable checkpoints are
fully sharded training's (:mod:`hetfair.parallel.fully_sharded`), so it stays exact.

Which ranks share a node is found at start-up in one exchange
(:mod:`hetfair.parallel.nodes`), or given: ``--shard-group-size N`` shards over
groups of N consecutive ranks (also to try the mode on one machine).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from hetfair.errors import ConfigError
from hetfair.parallel import cost_model, register_strategy
from hetfair.parallel.config import ParallelConfig
from hetfair.parallel.context import DistributedContext
from hetfair.parallel.fully_sharded import FullyShardedStrategy
from hetfair.parallel.strategy import Strategy
from hetfair.parallel.nodes import gather_layout, rank_blocks

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@register_strategy("hybrid_sharded")
class HybridShardedStrategy(FullyShardedStrategy):
    """Fully sharded over the ranks of a node (or of ``--shard-group-size``), replicated over the nodes."""

    takes_shard_fractions = False  # FSDP2's even shards inside each node
    plan_role = None  # --ddp-backend auto shards over every rank (fully_sharded), never per node
    owned_flags = ("--no-reshard-after-forward", "--reduce-dtype", "--shard-group-size")

    def __init__(self, config: ParallelConfig, context: DistributedContext) -> None:
        super().__init__(config, context)
        self.layout: list[list[int]] = []
        """The ranks of each node (a row of the mesh), once the model is sharded."""

    @classmethod
    def variant(cls, config: ParallelConfig) -> type[Strategy]:
        return cls

    @classmethod
    def cost_variants(cls, name: str, job: cost_model.Job) -> list[ParallelConfig]:
        """On several nodes of the same number of devices, more than one each."""
        counts = {sum(1 for rank in job.ranks if rank.node == node) for node in range(job.nodes)}
        return [ParallelConfig(name)] if job.nodes > 1 and len(counts) == 1 and job.per_node > 1 else []

    @classmethod
    def predict(cls, config: ParallelConfig, job: cost_model.Job) -> cost_model.UpdateCost:
        return cost_model.hybrid_sharded(job)

    @classmethod
    def check_world(cls, config: ParallelConfig, world_size: int) -> None:
        super().check_world(config, world_size)
        size = config.shard_group_size
        if size is not None and world_size % size:
            raise ConfigError(f"--shard-group-size {size} does not divide the {world_size} processes of the job; "
                              f"give a divisor of --distributed-world-size")

    def device_mesh(self) -> Optional["DeviceMesh"]:
        from hetfair.parallel import fsdp2_engine as fsdp  # torch's FSDP: imported only when used

        size = self.config.shard_group_size
        self.layout = (rank_blocks(self.context.world_size, size) if size is not None
                       else gather_layout(self.context))
        return fsdp.hybrid_mesh(self.context.device.type, self.layout)

    def state_shares(self, rank: int) -> tuple[float, float]:
        share = 1.0 / next(len(node) for node in self.layout if rank in node)
        return share, share

    def shard_report(self, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        """The mesh: how many nodes replicate the model, and how many ranks shard it in each."""
        return {"nodes": len(self.layout), "ranks_per_node": len(self.layout[0])}

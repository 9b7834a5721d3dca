"""``--ddp-backend c10d``: every rank holds the whole model; DDP all-reduces the gradients.

With ``--zero-sharding os`` the optimizer state is sharded (ZeRO stage 1,
:mod:`hetfair.parallel.zero_sharding`): only the optimizer changes, gradients stay full
and identical on every rank, so normalising, clipping and overflows need no
communication of their own. ``--ddp-comm-hook`` puts one of torch's communication
hooks on DDP (:mod:`hetfair.parallel.gradient_comm`): the gradients it leaves are still
the same on every rank.
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, ContextManager, Optional, Sequence

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hetfair.parallel import cost_model
from hetfair.parallel import zero_sharding as zero
from hetfair.parallel import register_strategy
from hetfair.parallel.comm_hook import check_comm_hook
from hetfair.parallel.gradient_comm import GradientComm
from hetfair.parallel.config import ParallelConfig
from hetfair.parallel.strategy import Strategy

if TYPE_CHECKING:
    from hetfair.optim import HetfairOptimizer
    from hetfair.parallel.context import DistributedContext


@register_strategy("c10d")
class ReplicatedStrategy(Strategy):
    """DistributedDataParallel over the whole model (nothing to wrap on one process); ZeRO-1 and a
    communication hook on request."""

    owned_flags = ("--zero-sharding", "--ddp-comm-hook", "--find-unused-parameters", "--bucket-cap-mb")
    plan_role = "replicated"

    def __init__(self, config: ParallelConfig, context: "DistributedContext") -> None:
        super().__init__(config, context)
        self._comm: Optional[GradientComm] = None

    @classmethod
    def check_options(cls, config: ParallelConfig) -> None:
        if config.zero_shard_weights is not None:
            zero.parse_shard_weights(config.zero_shard_weights)
        check_comm_hook(config)

    @classmethod
    def check_world(cls, config: ParallelConfig, world_size: int) -> None:
        zero.check_sharding(config.zero_sharding, config.zero_shard_weights, world_size)

    @classmethod
    def live_recovery_refusal(cls, config: ParallelConfig) -> Optional[str]:
        if cls.takes_shard_weights(config):
            return ("--zero-sharding os: a lost rank's optimizer shard cannot be rebuilt from the others; "
                    "drop --zero-sharding")
        return None

    @classmethod
    def takes_shard_weights(cls, config: ParallelConfig) -> bool:
        return config.zero_sharding != "none"

    @classmethod
    def cost_variants(cls, name: str, job: "cost_model.Job") -> list[ParallelConfig]:
        """Every comm hook setting the model's costs list and ZeRO-1 with the exact all-reduce; on one process, DDP
        alone (nothing to communicate)."""
        if job.world == 1:
            return [ParallelConfig(name)]
        hooks = [ParallelConfig(name, ddp_comm_hook=hook.name, comm_options=hook.options) for hook in job.model.hooks]
        return [*hooks, ParallelConfig(name, zero_sharding="os")]

    @classmethod
    def predict(cls, config: ParallelConfig, job: "cost_model.Job") -> "cost_model.UpdateCost":
        hook = job.model.hook(config.ddp_comm_hook, config.comm_options)
        return cost_model.replicated(job, hook.sent, zero=config.zero_sharding != "none")

    @classmethod
    def changes_numbers(cls, config: ParallelConfig, job: "cost_model.Job") -> bool:
        return job.model.hook(config.ddp_comm_hook, config.comm_options).lossy

    def wrap(self, model: nn.Module) -> nn.Module:
        if not self.context.is_distributed:
            return model
        device = self.context.device
        ddp = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=self.config.find_unused_parameters,
            bucket_cap_mb=self.config.bucket_cap_mb,
            gradient_as_bucket_view=True,  # gradients live in DDP's buckets: no copy in or out
        )
        self._comm = GradientComm(ddp, self.config, self.context)
        return ddp

    def build_optimizer(self, recipe: type["HetfairOptimizer"], args: argparse.Namespace,
                        params: list[nn.Parameter]) -> torch.optim.Optimizer:
        if self.config.zero_sharding == "none":
            return recipe.build(args, params)
        return zero.build_sharded_optimizer(recipe, args, params, self.config.zero_shard_weights,
                                            self.context.world_size)

    @property
    def joins_every_micro_batch(self) -> bool:
        return False  # DDP communicates in the last micro-batch's backward only

    def gradient_sync(self, wrapped: nn.Module, is_last: bool) -> ContextManager[Any]:
        if is_last or not self.context.is_distributed:
            return nullcontext()
        return wrapped.no_sync()  # type: ignore[operator]

    def discard_update(self) -> None:
        if self._comm is not None:
            self._comm.discard_update()

    def gradient_comm(self) -> Optional[GradientComm]:
        return self._comm

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                             params: Sequence[nn.Parameter]) -> Optional[dict[str, Any]]:
        return zero.full_state_dict(optimizer, self.context)

    def shard_report(self, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        return zero.shard_report(optimizer, self.context)

    def state_shares(self, rank: int) -> tuple[float, float]:
        if self.config.zero_sharding == "none":
            return 1.0, 1.0
        return 1.0, zero.weight_share(self.config.zero_shard_weights, rank, self.context.world_size)

    def held_state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        return {**super().held_state_bytes(optimizer), "optimizer": zero.optimizer_state_bytes(optimizer)}

"""What every fully sharded engine shares: its option checks, a shard of each gradient on every rank, and so
the ranks' agreement on an fp16 overflow.

FSDP2 (:mod:`hetfair.parallel.fully_sharded`) and the uneven engine
(:mod:`hetfair.parallel.uneven_sharded`) both gather parameters in every forward and
backward and leave each rank with its own gradient shards.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from hetfair.errors import ConfigError
from hetfair.parallel.config import ParallelConfig
from hetfair.parallel.strategy import Strategy, refusal_of_backend

REDUCE_DTYPES: dict[str, Optional[torch.dtype]] = {"fp32": None, "bf16": torch.bfloat16}
"""``--reduce-dtype``: the dtype gradients are reduced in (``None``: their own, fp32)."""


class ShardedGradientsStrategy(Strategy):
    """A mode whose ranks each hold a shard of every parameter and gradient (``--ddp-backend fully_sharded``)."""

    takes_shard_fractions = True
    plan_role = "sharded"
    owned_flags = ("--no-reshard-after-forward", "--reduce-dtype", "--shard-fractions", "--offload")

    @classmethod
    def live_recovery_refusal(cls, config: ParallelConfig) -> Optional[str]:
        return refusal_of_backend(config, "a lost rank's parameter shards cannot be rebuilt from the others")

    @classmethod
    def check_world(cls, config: ParallelConfig, world_size: int) -> None:
        if world_size < 2:
            raise ConfigError(f"--ddp-backend {config.ddp_backend} needs more than one process "
                              f"(--distributed-world-size N)")
        fractions = config.shard_fractions
        if fractions is not None and len(fractions) != world_size:
            raise ConfigError(f"--shard-fractions has {len(fractions)} values but the job has {world_size} processes; "
                              f"give one per rank")

    def state_shares(self, rank: int) -> tuple[float, float]:
        fractions = self.config.shard_fractions
        share = fractions[rank] if fractions is not None else 1.0 / self.context.world_size
        return share, share

    @property
    def joins_every_micro_batch(self) -> bool:
        return True  # every forward and backward gathers parameters

    @property
    def holds_full_gradients(self) -> bool:
        return False

    def agree_on_overflow(self, found_inf: torch.Tensor) -> None:
        flag = found_inf.to(self.context.device)  # offloaded shards flag on the CPU; NCCL reduces on the device
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        found_inf.copy_(flag)

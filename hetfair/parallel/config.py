"""The parallelism section of a run's configuration: which strategy, and how it shards and communicates."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class ParallelConfig:
    """``--ddp-backend`` (the strategy's registry name) and the flags the built-in strategies read."""

    ddp_backend: str = "c10d"
    """The strategy: ``c10d`` replicates the model (DDP), ``fully_sharded`` shards it (FSDP2), or a plugin's."""
    zero_sharding: str = "none"
    """Replicated: ``os`` shards the optimizer state over the ranks (ZeRO stage 1)."""
    zero_shard_weights: Optional[str] = None
    """Replicated with ``os``: one weight per rank (text, as given); a rank's shard grows in proportion."""
    reshard_after_forward: bool = True
    """Fully sharded: free each unit's gathered parameters after its forward."""
    find_unused_parameters: bool = False
    """Replicated: let DDP handle parameters that get no gradient."""
    bucket_cap_mb: float = 25.0
    """Replicated: DDP's gradient bucket size in MiB."""
    reduce_dtype: str = "fp32"
    """Fully or hybrid sharded: the dtype gradients are reduce-scattered (and all-reduced) in, ``fp32`` or ``bf16``."""
    shard_group_size: Optional[int] = None
    """Hybrid sharded: shard over this many consecutive ranks (default: the ranks of each node)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ParallelConfig":
        return cls(args.ddp_backend, args.zero_sharding, args.zero_shard_weights, not args.no_reshard_after_forward,
                   args.find_unused_parameters, args.bucket_cap_mb, reduce_dtype=args.reduce_dtype,
                   shard_group_size=args.shard_group_size)

    def shared_settings(self) -> dict[str, Any]:
        """The flags every rank must be given alike (their collectives differ otherwise), by flag."""
        return {"--ddp-backend": self.ddp_backend, "--zero-sharding": self.zero_sharding,
                "--zero-shard-weights": self.zero_shard_weights, "--reduce-dtype": self.reduce_dtype,
                "--shard-group-size": self.shard_group_size}

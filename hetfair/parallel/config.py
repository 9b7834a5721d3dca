"""The parallelism section of a run's configuration: which strategy, and how it shards and communicates."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Optional

from hetfair.errors import ConfigError
from hetfair.parallel.comm_hook import options_from_args

ZERO_SHARDINGS = ("none", "os")
"""``--zero-sharding`` choices: the replicated strategy's optimizer state whole on every rank, or sharded (ZeRO-1)."""

ZERO_SHARDING_FLAGS: dict[str, tuple[str, ...]] = {"os": ("--zero-shard-weights",)}
"""The flags each ``--zero-sharding`` mode owns: refused with any other."""


def parse_shard_fractions(text: Optional[str]) -> Optional[tuple[float, ...]]:
    """``--shard-fractions 1,3`` -> ``(0.25, 0.75)`` (normalised to sum to 1); ``None`` stays ``None``."""
    if text is None:
        return None
    try:
        values = [float(item) for item in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(value > 0 for value in values) or not math.isfinite(sum(values)):
        raise ConfigError(f"--shard-fractions {text}: give one positive finite number per rank, like 1,3")
    total = sum(values)
    return tuple(value / total for value in values)


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
    outer_interval: Optional[int] = None
    """Outer loop (localsgd, diloco): inner updates per outer round (``None``: not given, 8)."""
    outer_lr: Optional[float] = None
    """DiLoCo: the outer SGD's learning rate (``None``: not given, 0.7 as in the DiLoCo paper)."""
    outer_momentum: Optional[float] = None
    """DiLoCo: the outer SGD's Nesterov momentum (``None``: not given, 0.9 as in the DiLoCo paper)."""
    outer_fragments: int = 1
    """Outer loop: the fragments the model is split into, meeting in turn (Streaming DiLoCo)."""
    outer_overlap: bool = False
    """Outer loop: exchange each fragment's pseudo-gradient in the background, applied at the next meeting."""
    outer_reduce_dtype: str = "fp32"
    """Outer loop: how pseudo-gradients cross the link, ``fp32`` (exact) or packed ``bf16``, ``int8``, ``int4``."""
    inner_steps_by: str = "count"
    """Outer loop: one inner step per update on every node (``count``), or as many as each node's speed allows
    (``time``, :mod:`hetfair.parallel.inner_steps`)."""
    reduce_dtype: str = "fp32"
    """Fully or hybrid sharded: the dtype gradients are reduce-scattered (and all-reduced) in, ``fp32`` or ``bf16``."""
    shard_group_size: Optional[int] = None
    """Hybrid sharded: shard over this many consecutive ranks (default: the ranks of each node)."""
    shard_fractions: Optional[tuple[float, ...]] = None
    """Fully sharded: each rank's share of the sharded state, by rank (``None``: equal shares)."""
    offload: bool = False
    """Fully sharded with fractions: THIS process keeps its shards and optimizer state in host memory (not shared)."""
    ddp_comm_hook: str = "none"
    """Replicated: a registered comm hook (:mod:`hetfair.parallel.comm_hook`; ``none``: DDP's own exact
    all-reduce) or ``auto``."""
    pipeline_stages: int = 2
    """Pipeline: the stages each pipeline's model is cut into (a rank runs one, or two with ``interleaved``)."""
    pipeline_schedule: str = "1f1b"
    """Pipeline: torch's schedule, ``gpipe``, ``1f1b`` or ``interleaved`` (two stages per rank)."""
    pipeline_microbatches: int = 4
    """Pipeline: the micro-batches each step's share of a pipeline is cut into (the stages of one pipeline agree)."""
    pipeline_split: str = "even"
    """Pipeline: sharding units per stage, ``even``, ``auto`` (by each stage's measured speed and memory) or
    ``4,8`` by hand."""
    pipeline_layout: str = "across"
    """Pipeline: ``across`` puts stage s of every pipeline on consecutive ranks (a node holds a stage, pipelines
    cross the nodes), ``inside`` a pipeline's stages on consecutive ranks."""
    rank_speeds: Optional[tuple[float, ...]] = None
    """Each rank's samples per second through the whole model, measured at start-up where the strategy wants them
    (:meth:`Strategy.wants_rank_speeds`: ``--pipeline-split auto``); ``None``: not measured."""
    rank_budgets: Optional[tuple[Optional[int], ...]] = None
    """With :attr:`rank_speeds`: each rank's memory budget in bytes (``None``: none known)."""
    optimizer_ratio: float = 0.0
    """With :attr:`rank_speeds`: the optimizer's state per byte of parameters."""
    comm_options: tuple[tuple[str, Any], ...] = ()
    """Every comm hook's own flags with their values (``("--powersgd-rank", 1), ...``); a flag not here takes
    its default."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ParallelConfig":
        return cls(args.ddp_backend, args.zero_sharding, args.zero_shard_weights, not args.no_reshard_after_forward,
                   args.find_unused_parameters, args.bucket_cap_mb, args.outer_interval, args.outer_lr,
                   args.outer_momentum, outer_fragments=args.outer_fragments, outer_overlap=args.outer_overlap,
                   outer_reduce_dtype=args.outer_reduce_dtype,
                   inner_steps_by=args.inner_steps_by, reduce_dtype=args.reduce_dtype, shard_group_size=args.shard_group_size,
                   shard_fractions=parse_shard_fractions(args.shard_fractions),
                   offload=bool(args.offload), ddp_comm_hook=args.ddp_comm_hook,
                   pipeline_stages=args.pipeline_stages, pipeline_schedule=args.pipeline_schedule,
                   pipeline_microbatches=args.pipeline_microbatches, pipeline_split=args.pipeline_split,
                   pipeline_layout=args.pipeline_layout, comm_options=options_from_args(args))

    def settings(self) -> dict[str, Any]:
        """Every flag of this section that a command gives, by flag: :meth:`shared_settings` and those a process
        may give on its own (``--pipeline-microbatches``: pipelines may differ)."""
        return {**self.shared_settings(), "--pipeline-microbatches": self.pipeline_microbatches}

    def shared_settings(self) -> dict[str, Any]:
        """The flags every rank must be given alike (their collectives differ otherwise), by flag."""
        return {"--ddp-backend": self.ddp_backend, "--zero-sharding": self.zero_sharding,
                "--zero-shard-weights": self.zero_shard_weights, "--outer-interval": self.outer_interval,
                "--outer-lr": self.outer_lr, "--outer-momentum": self.outer_momentum,
                "--outer-fragments": self.outer_fragments, "--outer-overlap": self.outer_overlap,
                "--outer-reduce-dtype": self.outer_reduce_dtype, "--inner-steps-by": self.inner_steps_by,
                "--reduce-dtype": self.reduce_dtype, "--shard-group-size": self.shard_group_size,
                "--shard-fractions": self.shard_fractions,
                "--ddp-comm-hook": self.ddp_comm_hook, "--pipeline-stages": self.pipeline_stages,
                "--pipeline-schedule": self.pipeline_schedule, "--pipeline-split": self.pipeline_split,
                "--pipeline-layout": self.pipeline_layout, **dict(self.comm_options)}

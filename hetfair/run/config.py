"""A training run's configuration in sections, one typed config per concern, built from the options at the edge.

:class:`RunConfig` gathers them: the loop (when to stop, log, validate), the data
(batch sizes and the update shape), checkpoints, parallelism, precision and load
balancing. The training loop reads these, not the option namespace; components
(task, model, criterion, optimizer) still get their own flags from it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from hetfair.balance import BalanceConfig
from hetfair.checkpoint.layout import CheckpointConfig
from hetfair.parallel import ParallelConfig
from hetfair.precision.mixed import LossScaleConfig


@dataclass(frozen=True)
class LoopConfig:
    """When the loop stops, logs and validates."""

    max_epoch: int = 0
    """Stop after this many epochs (0: no limit)."""
    max_update: int = 0
    """Stop after this many updates (0: no limit)."""
    log_interval: int = 100
    validate_interval: int = 1
    """Validate every this many epochs."""
    validate_interval_updates: int = 0
    """Also validate every this many updates (0: off)."""
    disable_validation: bool = False
    valid_subsets: tuple[str, ...] = ("valid",)
    """The splits to validate on; the first one's metric picks the best checkpoint."""
    best_checkpoint_metric: str = "loss"
    seed: int = 1
    log_format: Optional[str] = None
    tensorboard_logdir: Optional[str] = None
    dry_run: bool = False
    """Show the plan and stop: nothing trains, nothing is written."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "LoopConfig":
        return cls(args.max_epoch, args.max_update, args.log_interval, args.validate_interval,
                   args.validate_interval_updates, args.disable_validation, tuple(args.valid_subset.split(",")),
                   args.best_checkpoint_metric, args.seed, args.log_format, args.tensorboard_logdir, args.dry_run)


@dataclass(frozen=True)
class DataConfig:
    """What this process reads and how much of each global batch it can take."""

    task: str = ""
    """The task's registry name, for messages."""
    train_subset: str = "train"
    num_workers: int = 0
    max_sentences: Optional[int | str] = None
    """Samples per micro-batch on this process (``auto`` until the plan chooses)."""
    max_tokens: Optional[int | str] = None
    """Tokens per micro-batch on this process (``auto`` until the plan chooses)."""
    max_sentences_valid: Optional[int] = None
    """Validation samples per batch on this process (default: ``max_sentences``)."""
    global_batch_size: Optional[int] = None
    """Samples per step over all processes (default: the checkpoint's, else the sum of the batch sizes)."""
    update_freq: Optional[int] = None
    """Steps per update as typed (``None``: not typed, so 1 or, resuming, as the checkpoint's updates need)."""
    fixed_update_freq: bool = False
    """Fail rather than raise ``update_freq`` when a step does not fit the processes."""
    auto_balance: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "DataConfig":
        return cls(args.task, args.train_subset, args.num_workers, args.max_sentences, args.max_tokens,
                   args.max_sentences_valid, args.global_batch_size, args.update_freq, args.fixed_update_freq,
                   args.auto_balance)


@dataclass(frozen=True)
class PrecisionConfig:
    """This process's precision and the job's loss-scaling flags."""

    precision: str = "fp32"
    loss_scale: LossScaleConfig = LossScaleConfig()

    @classmethod
    def from_args(cls, args: argparse.Namespace, world_size: int) -> "PrecisionConfig":
        return cls(args.precision, LossScaleConfig.from_args(args, world_size))


@dataclass(frozen=True)
class MemoryConfig:
    """What this process's training state and micro-batch may occupy."""

    budget: Optional[int] = None
    """``--memory-budget`` in bytes (``None``: on CUDA the device's free memory, on CPU no limit)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "MemoryConfig":
        return cls(args.memory_budget)


@dataclass(frozen=True)
class RunConfig:
    """Every section of one process's training run."""

    loop: LoopConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    parallel: ParallelConfig
    precision: PrecisionConfig
    balance: BalanceConfig
    memory: MemoryConfig = MemoryConfig()

    @classmethod
    def from_args(cls, args: argparse.Namespace, world_size: int, balance_lag: int = 0) -> "RunConfig":
        """The sections of ``args`` for a job of ``world_size`` processes; the balancer sees timings
        ``balance_lag`` updates late."""
        return cls(LoopConfig.from_args(args), DataConfig.from_args(args), CheckpointConfig.from_args(args),
                   ParallelConfig.from_args(args), PrecisionConfig.from_args(args, world_size),
                   BalanceConfig.from_args(args, lag=balance_lag), MemoryConfig.from_args(args))

"""Polynomial decay from ``--lr`` to ``--end-learning-rate`` at ``--total-num-update``."""

from __future__ import annotations

import argparse

import torch

from hetfair.errors import ConfigError
from hetfair.optim import register_lr_scheduler
from hetfair.optim.lr_scheduler.scheduler import LRScheduler


@register_lr_scheduler("polynomial_decay")
class PolynomialDecaySchedule(LRScheduler):
    """BERT's schedule: warm-up, then ``(lr - end) * (1 - progress) ** power + end``."""

    def __init__(self, args: argparse.Namespace, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(args, optimizer)
        self.total = args.total_num_update or args.max_update
        if not self.total:
            raise ConfigError("polynomial_decay needs --total-num-update (or --max-update)")
        if self.total <= self.warmup_updates:
            raise ConfigError(
                f"--total-num-update ({self.total}) must be larger than --warmup-updates ({self.warmup_updates})"
            )
        self.end_lr = args.end_learning_rate
        self.power = args.power

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--total-num-update", type=int, default=0,
                            help="update at which the decay ends (default: --max-update)")
        parser.add_argument("--end-learning-rate", type=float, default=0.0, help="learning rate at the end")
        parser.add_argument("--power", type=float, default=1.0, help="decay exponent (1 = linear)")

    def decayed_lr(self, num_updates: int) -> float:
        if num_updates >= self.total:
            return self.end_lr
        progress = (num_updates - self.warmup_updates) / (self.total - self.warmup_updates)
        return (self.base_lr - self.end_lr) * (1.0 - progress) ** self.power + self.end_lr

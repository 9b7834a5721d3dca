"""Cosine annealing from ``--lr`` to ``--min-lr`` over the run."""

from __future__ import annotations

import argparse
import math

import torch

from hetfair.errors import ConfigError
from hetfair.optim import register_lr_scheduler
from hetfair.optim.lr_scheduler.scheduler import LRScheduler


@register_lr_scheduler("cosine")
class CosineSchedule(LRScheduler):
    """Half a cosine period from the end of warm-up to ``--total-num-update``."""

    def __init__(self, args: argparse.Namespace, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(args, optimizer)
        self.total = args.total_num_update or args.max_update
        if not self.total or self.total <= self.warmup_updates:
            raise ConfigError("cosine needs --total-num-update (or --max-update) larger than --warmup-updates")
        self.min_lr = args.min_lr

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--total-num-update", type=int, default=0,
                            help="update at which the cosine reaches --min-lr (default: --max-update)")
        parser.add_argument("--min-lr", type=float, default=0.0, help="learning rate at the end")

    def decayed_lr(self, num_updates: int) -> float:
        progress = min((num_updates - self.warmup_updates) / (self.total - self.warmup_updates), 1.0)
        return self.min_lr + 0.5 * (self.base_lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))

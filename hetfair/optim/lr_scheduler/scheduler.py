"""The :class:`LRScheduler` base: learning rate as a function of the update count."""

from __future__ import annotations

import argparse
from typing import Any

import torch


class LRScheduler:
    """Sets the learning rate of every parameter group before each update.

    Every scheduler gets linear warm-up over ``--warmup-updates`` (a core flag);
    subclasses implement :meth:`decayed_lr` for the updates after warm-up.
    """

    def __init__(self, args: argparse.Namespace, optimizer: torch.optim.Optimizer) -> None:
        self.args = args
        self.optimizer = optimizer
        self.base_lr = float(args.lr)
        self.warmup_updates = int(args.warmup_updates)

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        """Add this scheduler's flags to ``parser``."""

    def decayed_lr(self, num_updates: int) -> float:
        """Learning rate after warm-up, for the update following ``num_updates`` done ones."""
        return self.base_lr

    def lr_at(self, num_updates: int) -> float:
        if num_updates < self.warmup_updates:
            return self.base_lr * (num_updates + 1) / self.warmup_updates
        return self.decayed_lr(num_updates)

    def step_update(self, num_updates: int) -> float:
        """Set and return the learning rate for the next update."""
        lr = self.lr_at(num_updates)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def step_epoch(self, epoch: int, valid_loss: float | None) -> None:
        """Hook called after each epoch's validation (no-op by default)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state saved by :meth:`state_dict`."""

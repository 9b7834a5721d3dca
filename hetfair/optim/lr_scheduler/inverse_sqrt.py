"""Inverse square-root decay after warm-up (the Transformer schedule)."""

import math

from hetfair.optim import register_lr_scheduler
from hetfair.optim.lr_scheduler.scheduler import LRScheduler


@register_lr_scheduler("inverse_sqrt")
class InverseSqrtSchedule(LRScheduler):
    """``lr * sqrt(warmup / n)`` for update ``n`` after warm-up."""

    def decayed_lr(self, num_updates: int) -> float:
        warmup = max(self.warmup_updates, 1)
        return self.base_lr * math.sqrt(warmup / max(num_updates, warmup))

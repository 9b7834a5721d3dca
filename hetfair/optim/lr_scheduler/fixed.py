"""Constant learning rate (after optional warm-up)."""

from hetfair.optim import register_lr_scheduler
from hetfair.optim.lr_scheduler.scheduler import LRScheduler


@register_lr_scheduler("fixed")
class FixedSchedule(LRScheduler):
    """``lr`` throughout, after linear warm-up."""

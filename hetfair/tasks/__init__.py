"""Task registry. hetfair's own ``bert`` task comes from its family's spec (see :mod:`hetfair.families`)."""

from hetfair.registry import Registry
from hetfair.tasks.task import Task

TASK_REGISTRY: Registry[type[Task]] = Registry("task", Task, entry_point_group="hetfair.tasks")
register_task = TASK_REGISTRY.register

__all__ = ["Task", "TASK_REGISTRY", "register_task"]

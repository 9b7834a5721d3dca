"""Task registry; built-in tasks live in this package."""

from hetfair.registry import Registry
from hetfair.tasks.task import Task

TASK_REGISTRY: Registry[type[Task]] = Registry(
    "task", Task, entry_point_group="hetfair.tasks", builtin_modules=["hetfair.tasks.bert"]
)
register_task = TASK_REGISTRY.register

__all__ = ["Task", "TASK_REGISTRY", "register_task"]

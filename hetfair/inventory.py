"""``--list-plugins``: every registered name and where it comes from (no plugin imports)."""

from __future__ import annotations

from hetfair.criteria import CRITERION_REGISTRY
from hetfair.models import ARCH_REGISTRY, MODEL_REGISTRY
from hetfair.optim import LR_SCHEDULER_REGISTRY, OPTIMIZER_REGISTRY
from hetfair.registry import Registry
from hetfair.tasks import TASK_REGISTRY

REGISTRIES: tuple[Registry, ...] = (
    TASK_REGISTRY,
    MODEL_REGISTRY,
    ARCH_REGISTRY,
    CRITERION_REGISTRY,
    OPTIMIZER_REGISTRY,
    LR_SCHEDULER_REGISTRY,
)


def describe_plugins() -> str:
    """A readable table: one section per kind, one ``name  source`` line per component."""
    lines = []
    for registry in REGISTRIES:
        lines.append(f"{registry.plural}:")
        names = registry.names()
        width = max((len(n) for n in names), default=0)
        for name in names:
            lines.append(f"  {name.ljust(width)}  {registry.source(name)}")
        if not names:
            lines.append("  (none)")
    return "\n".join(lines)

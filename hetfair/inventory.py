"""``--list-plugins``: every registered name and where it comes from (no plugin imports), clashes included."""

from __future__ import annotations

from hetfair.criteria import CRITERION_REGISTRY
from hetfair.models import ARCH_REGISTRY, MODEL_REGISTRY, arch_model
from hetfair.optim import LR_SCHEDULER_REGISTRY, OPTIMIZER_REGISTRY
from hetfair.parallel import STRATEGY_REGISTRY
from hetfair.registry import Registry
from hetfair.tasks import TASK_REGISTRY

REGISTRIES: tuple[Registry, ...] = (
    TASK_REGISTRY,
    MODEL_REGISTRY,
    ARCH_REGISTRY,
    CRITERION_REGISTRY,
    OPTIMIZER_REGISTRY,
    LR_SCHEDULER_REGISTRY,
    STRATEGY_REGISTRY,
)
CLASH = "<- clash"


def describe_plugins() -> str:
    """A readable table: one section per kind, one ``name  source`` line per definition.

    An architecture whose plugin is imported also names its model; a name defined
    more than once gets one line per definition, marked :data:`CLASH`.
    """
    lines = []
    for registry in REGISTRIES:
        lines.append(f"{registry.plural}:")
        names = registry.names()
        width = max((len(n) for n in names), default=0)
        for name in names:
            definitions = registry.definitions(name)
            model = arch_model(name) if registry is ARCH_REGISTRY else None
            for definition in definitions:
                line = f"  {name.ljust(width)}  {definition}" + (f", model {model}" if model else "")
                lines.append(f"{line}  {CLASH}" if len(definitions) > 1 else line)
        if not names:
            lines.append("  (none)")
    return "\n".join(lines)


def clashes() -> list[str]:
    """One line per name that several plugins define: ``task 'x': A and B``."""
    return [f"{registry.kind} '{name}': {' and '.join(definitions)}"
            for registry in REGISTRIES for name in registry.names()
            if len(definitions := registry.definitions(name)) > 1]

"""``--list-plugins``: every registered name and where it comes from (no plugin imports), clashes included."""

from __future__ import annotations

from hetfair.criteria import CRITERION_REGISTRY
from hetfair.families import FAMILY_REGISTRY, FamilyRegistry
from hetfair.models import ARCH_REGISTRY, MODEL_REGISTRY, arch_model
from hetfair.optim import LR_SCHEDULER_REGISTRY, OPTIMIZER_REGISTRY
from hetfair.parallel import COMM_HOOK_REGISTRY, STRATEGY_REGISTRY
from hetfair.registry import Registry
from hetfair.tasks import TASK_REGISTRY

REGISTRIES: tuple[Registry | FamilyRegistry, ...] = (
    FAMILY_REGISTRY,
    TASK_REGISTRY,
    MODEL_REGISTRY,
    ARCH_REGISTRY,
    CRITERION_REGISTRY,
    OPTIMIZER_REGISTRY,
    LR_SCHEDULER_REGISTRY,
    STRATEGY_REGISTRY,
    COMM_HOOK_REGISTRY,
)
CLASH = "<- clash"


def describe_plugins() -> str:
    """A readable table: one section per kind, one ``name  source`` line per definition.

    A family says what else it brings (preprocessor, Hugging Face export and import) and a family that failed
    to load is one line of its own; an architecture whose plugin is imported also names its model; a name
    defined more than once gets one line per definition, marked :data:`CLASH`.
    """
    lines = []
    for registry in REGISTRIES:
        lines.append(f"{registry.plural}:")
        names = registry.names()
        width = max((len(n) for n in names), default=0)
        for name in names:
            definitions = registry.definitions(name)
            model = arch_model(name) if registry is ARCH_REGISTRY else None
            extra = _family_parts(name) if registry is FAMILY_REGISTRY and len(definitions) == 1 else ""
            for definition in definitions:
                line = f"  {name.ljust(width)}  {definition}" + (f", model {model}" if model else "") + extra
                lines.append(f"{line}  {CLASH}" if len(definitions) > 1 else line)
        failures = FAMILY_REGISTRY.failures() if registry is FAMILY_REGISTRY else []
        lines += [f"  (not loaded) {failure}" for failure in failures]
        if not names and not failures:
            lines.append("  (none)")
    return "\n".join(lines)


def _family_parts(name: str) -> str:
    """``", preprocessor, exports to hf, imports hf (--init-from-hf)"``: what the family brings besides components."""
    spec = FAMILY_REGISTRY.get(name).spec
    parts = (["preprocessor"] if spec.preprocessor else []) + (["exports to hf"] if spec.hf_exporter else []) + (
        [f"imports hf ({spec.hf_import_flag})"] if spec.hf_import_flag else [])
    return "".join(f", {part}" for part in parts)


def clashes() -> list[str]:
    """One line per name that several plugins define: ``task 'x': A and B``."""
    return [f"{registry.kind} '{name}': {' and '.join(definitions)}"
            for registry in REGISTRIES for name in registry.names()
            if len(definitions := registry.definitions(name)) > 1]

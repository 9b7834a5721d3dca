"""Model and architecture registries.

An *architecture* is a named preset of a model's hyper-parameters: a function
returning a dict of option defaults, registered with
``@register_model_architecture(model_name, arch_name)`` and chosen with
``--arch``. Every model name is also usable as ``--arch`` (its own defaults).

Models and architectures of installed distributions are entry points
(``hetfair.models`` and ``hetfair.archs``), imported only when chosen; an
architecture declared as an entry point is listed before its module is imported. A model
family's spec (:mod:`hetfair.families`) declares its models and architectures the same way;
hetfair's own families are registered so (see :mod:`hetfair.bert`).
"""

from __future__ import annotations

from typing import Any, Callable

from hetfair.errors import ComponentNotKnownError, ConfigError, HetfairError
from hetfair.models.model import HetfairModel
from hetfair.registry import Registry

ArchFunction = Callable[[], dict[str, Any]]

MODEL_REGISTRY: Registry[type[HetfairModel]] = Registry("model", HetfairModel, entry_point_group="hetfair.models")
ARCH_REGISTRY: Registry[ArchFunction] = Registry("arch", None, entry_point_group="hetfair.archs")
_ARCH_MODEL: dict[str, str] = {}

register_model = MODEL_REGISTRY.register


def register_model_architecture(model_name: str, arch_name: str) -> Callable[[ArchFunction], ArchFunction]:
    """Register ``fn() -> dict`` as architecture ``arch_name`` of model ``model_name``."""

    def decorator(fn: ArchFunction) -> ArchFunction:
        ARCH_REGISTRY.add(arch_name, fn)
        _ARCH_MODEL[arch_name] = model_name
        return fn

    return decorator


def arch_model(arch: str) -> str | None:
    """The model of a registered architecture (``None`` while its plugin is not imported)."""
    return _ARCH_MODEL.get(arch)


def arch_names() -> list[str]:
    """Architecture names plus every model name (a model is its own default arch)."""
    return sorted(set(ARCH_REGISTRY.names()) | set(MODEL_REGISTRY.names()))


def resolve_arch(arch: str) -> tuple[str, dict[str, Any]]:
    """``--arch`` value -> (model name, option defaults of that architecture)."""
    if arch not in ARCH_REGISTRY.names() and arch not in MODEL_REGISTRY.names():
        _import_plugin_models()
    if arch not in ARCH_REGISTRY.names():
        if arch not in MODEL_REGISTRY.names():
            raise ComponentNotKnownError(f"unknown arch '{arch}'; known archs: {', '.join(arch_names())}")
        MODEL_REGISTRY.get(arch)  # importing a plugin model may register its archs
        if arch not in ARCH_REGISTRY.names():
            return arch, {}
    arch_fn = ARCH_REGISTRY.get(arch)  # imports the module of an arch entry point, which registers it
    model_name = _ARCH_MODEL[arch]
    defaults = arch_fn()
    if not isinstance(defaults, dict):
        raise ConfigError(f"architecture '{arch}' must return a dict of option defaults, got {type(defaults).__name__}")
    return model_name, defaults


def _import_plugin_models() -> None:
    """Import every installed model plugin: their architectures are only known once imported.

    Only used when ``--arch`` names nothing known so far; a plugin that fails to
    import here is skipped (its error is reported when its own name is chosen).
    """
    for name in MODEL_REGISTRY.names():
        try:
            MODEL_REGISTRY.get(name)
        except HetfairError:
            continue


__all__ = [
    "HetfairModel",
    "MODEL_REGISTRY",
    "ARCH_REGISTRY",
    "register_model",
    "register_model_architecture",
    "arch_model",
    "arch_names",
    "resolve_arch",
]

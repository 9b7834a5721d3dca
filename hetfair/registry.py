"""One generic registry used for every kind of pluggable component.

A name can come from four places, all going through :meth:`Registry.register`:
built-in modules of hetfair, a ``--user-dir`` package, an entry point of an
installed distribution, or a model family's spec (:mod:`hetfair.families`, itself
an entry point). Entry points and specs are listed without importing the components
they name, which are loaded only when their name is requested.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Generic, Iterable, Mapping, TypeVar

from hetfair.errors import (
    ComponentNotKnownError,
    ComponentTypeError,
    DuplicateComponentError,
    PluginLoadError,
)
from hetfair.families import FAMILY_REGISTRY
from hetfair.plugins import PluginEntryPoint, discover_entry_points

T = TypeVar("T")


@dataclass(frozen=True)
class Registration:
    """Where a registered object was defined."""

    obj: object
    module: str
    qualname: str

    @property
    def origin(self) -> str:
        return f"{self.module}.{self.qualname}"


def _origin_of(obj: object) -> tuple[str, str]:
    return getattr(obj, "__module__", "?"), getattr(obj, "__qualname__", repr(obj))


class Registry(Generic[T]):
    """Name -> component mapping for one kind (task, model, criterion, ...).

    Args:
        kind: human name used in messages, e.g. ``"task"``.
        base_class: registered classes must derive from it (``None``: any callable).
        entry_point_group: ``importlib.metadata`` group scanned for plugins, or ``None``.
        builtin_modules: hetfair modules imported on first use to register built-ins.
        plural: the kind in the plural, for messages (default: ``kind`` + "s").
        reserved: names no component may take, each with what the name means instead (e.g. ``auto``).
    """

    def __init__(
        self,
        kind: str,
        base_class: type | None,
        entry_point_group: str | None = None,
        builtin_modules: Iterable[str] = (),
        plural: str | None = None,
        reserved: Mapping[str, str] | None = None,
    ) -> None:
        self.kind = kind
        self.reserved = dict(reserved or {})
        self.plural = plural or f"{kind}s"
        self.base_class = base_class
        self.entry_point_group = entry_point_group
        self._builtin_modules = tuple(builtin_modules)
        self._builtins_imported = False
        self._entries: dict[str, Registration] = {}

    # -- registration -------------------------------------------------------
    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering a class (or, without base class, a callable) as ``name``."""

        def decorator(obj: T) -> T:
            self.add(name, obj)
            return obj

        return decorator

    def add(self, name: str, obj: T) -> None:
        """Register ``obj`` as ``name``; a different earlier definition, or a reserved name, is an error."""
        if name in self.reserved:
            module, qualname = _origin_of(obj)
            raise ComponentTypeError(f"cannot register {self.kind} '{name}' ({module}.{qualname}): "
                                     f"'{name}' is reserved ({self.reserved[name]}); choose another name")
        if self.base_class is not None:
            if not (isinstance(obj, type) and issubclass(obj, self.base_class)):
                module, qualname = _origin_of(obj)
                raise ComponentTypeError(
                    f"cannot register {self.kind} '{name}': {module}.{qualname} must be a subclass of "
                    f"{self.base_class.__module__}.{self.base_class.__qualname__}"
                )
        elif not callable(obj):
            raise ComponentTypeError(f"cannot register {self.kind} '{name}': {obj!r} is not callable")
        module, qualname = _origin_of(obj)
        new = Registration(obj, module, qualname)
        old = self._entries.get(name)
        # The same definition seen again (a module imported twice, e.g. a user dir
        # re-imported in a worker) replaces itself; anything else is a real clash.
        if old is not None and old.origin != new.origin:
            raise DuplicateComponentError(
                f"{self.kind} '{name}' is defined twice: by {old.origin} and by {new.origin}; rename one of them"
            )
        self._entries[name] = new

    # -- lookup --------------------------------------------------------------
    def names(self) -> list[str]:
        """Every known name: built-ins, imported plugins and (unimported) entry points."""
        self._import_builtins()
        return sorted(set(self._entries) | {ep.name for ep in self._entry_points()})

    def get(self, name: str) -> T:
        """The component registered as ``name``, importing its plugin if needed."""
        self._import_builtins()
        candidates = [ep for ep in self._entry_points() if ep.name == name]
        if len(candidates) > 1:
            raise DuplicateComponentError(
                f"{self.kind} '{name}' is provided by several plugins: "
                + " and ".join(ep.describe() for ep in candidates)
                + "; uninstall one of them"
            )
        entry_point = candidates[0] if candidates else None
        registered = self._entries.get(name)
        if registered is not None:
            if entry_point is not None and not _defined_by(entry_point, registered):
                raise DuplicateComponentError(
                    f"{self.kind} '{name}' is defined twice: by {registered.origin} and by "
                    f"{entry_point.describe()}; rename one of them"
                )
            return registered.obj  # type: ignore[return-value]
        if entry_point is None:
            broken = "".join(f"; {failure}" for failure in FAMILY_REGISTRY.failures())  # it may be theirs
            raise ComponentNotKnownError(
                f"unknown {self.kind} '{name}'; known {self.plural}: {', '.join(self.names()) or '(none)'}{broken}"
            )
        return self._load_entry_point(entry_point)

    def source(self, name: str) -> str:
        """Where ``name`` comes from, for messages and ``--list-plugins`` (never imports plugins)."""
        return self.definitions(name)[0]

    def definitions(self, name: str) -> list[str]:
        """Every definition of ``name``, described: more than one is a clash (never imports plugins).

        A name an entry point declares and its package registered when imported is one definition.
        """
        self._import_builtins()
        entry_points = [ep for ep in self._entry_points() if ep.name == name]
        found = [ep.source() for ep in entry_points]
        registration = self._entries.get(name)
        if registration is not None and not any(_defined_by(ep, registration) for ep in entry_points):
            where = "built-in" if registration.module.startswith("hetfair.") else "user code"
            found.append(f"{where} ({registration.origin})")
        if not found:
            raise ComponentNotKnownError(f"unknown {self.kind} '{name}'")
        return found

    # -- internals -------------------------------------------------------------
    def _import_builtins(self) -> None:
        if self._builtins_imported:
            return
        self._builtins_imported = True
        for module in self._builtin_modules:
            importlib.import_module(module)

    def _entry_points(self) -> list[PluginEntryPoint]:
        """The group's own entry points, then the components the model families' specs list for it."""
        if self.entry_point_group is None:
            return []
        return discover_entry_points(self.entry_point_group) + FAMILY_REGISTRY.components(self.entry_point_group)

    def _load_entry_point(self, entry_point: PluginEntryPoint) -> T:
        loaded = entry_point.load()
        if entry_point.name not in self._entries and isinstance(loaded, type):
            self.add(entry_point.name, loaded)  # type: ignore[arg-type]
        if entry_point.name not in self._entries:
            raise PluginLoadError(
                f"plugin {entry_point.describe()} was imported but did not register a {self.kind} "
                f"named '{entry_point.name}'"
            )
        return self._entries[entry_point.name].obj  # type: ignore[return-value]


def _defined_by(entry_point: PluginEntryPoint, registration: Registration) -> bool:
    """True when the registered object comes from the entry point's own package."""
    package = entry_point.module.split(".")[0]
    return registration.module == package or registration.module.startswith(package + ".")

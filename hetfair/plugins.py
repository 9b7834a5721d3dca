"""Plugin discovery: installed entry points and ``--user-dir`` packages.

Entry points are *listed* through :mod:`importlib.metadata` without importing
any plugin code; a plugin is imported only when its name is chosen. The
installed distributions are scanned once per process (for every group at
once) and the result is reused until ``sys.path`` changes or
:func:`clear_entry_point_cache` is called.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from functools import cached_property
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

from hetfair.errors import PluginLoadError


@dataclass(frozen=True)
class PluginEntryPoint:
    """One ``name = module[:attr]`` line of an installed distribution's entry points, or one component of a
    model family's spec (``family`` names it; ``_declared_by`` is the family's entry point)."""

    name: str
    value: str
    _entry_point: metadata.EntryPoint
    family: str | None = None
    _declared_by: metadata.EntryPoint | None = None

    @cached_property
    def distribution(self) -> str:
        """The installed distribution's name (read from its metadata only when asked: 5 ms per entry point)."""
        dist = self.installed.dist
        return dist.metadata["Name"] if dist is not None else "<unknown>"

    @cached_property
    def version(self) -> str:
        dist = self.installed.dist
        return dist.version if dist is not None else ""

    @property
    def installed(self) -> metadata.EntryPoint:
        """The entry point its distribution declares: its own, or its family's."""
        return self._declared_by if self._declared_by is not None else self._entry_point

    @property
    def module(self) -> str:
        return self.value.split(":", 1)[0].strip()

    def describe(self) -> str:
        where = f"family {self.family}: {self.name}" if self.family else f"entry point {self.name}"
        return f"distribution '{self.distribution}' {self.version} ({where} = {self.value})"

    def source(self) -> str:
        """:meth:`describe`, shorter for hetfair's own components (registered like plugins)."""
        if self.distribution != "hetfair":
            return self.describe()
        where = f"family {self.family}" if self.family else "entry point"
        return f"built-in ({self.value.replace(':', '.').replace(' ', '')}, {where} of hetfair)"

    def load(self) -> Any:
        """Import the plugin; any failure becomes one :class:`PluginLoadError` line."""
        try:
            return self._entry_point.load()
        except Exception as exc:  # noqa: BLE001 - any plugin failure must be reported, not crash listing
            raise PluginLoadError(
                f"plugin '{self.name}' from {self.describe()} failed to import: "
                f"{type(exc).__name__}: {exc}"
            ) from exc


# The one scan of installed entry points, valid for the sys.path it was made with.
_scan_path: tuple[str, ...] | None = None
_scanned: Any = None  # what metadata.entry_points() returned (all groups)
_by_group: dict[str, tuple[PluginEntryPoint, ...]] = {}
_generation = 0  # how many scans were forgotten: what is read from a scan is valid while it stays


def clear_entry_point_cache() -> None:
    """Forget the scan of installed entry points; the next lookup scans again.

    A change of ``sys.path`` does this by itself. Call it after installing or
    removing a distribution in a directory that is already on ``sys.path``.
    """
    global _scan_path, _scanned, _generation
    _generation += 1
    _scan_path = None
    _scanned = None
    _by_group.clear()


def discover_entry_points(group: str) -> list[PluginEntryPoint]:
    """All entry points of ``group`` across installed distributions (no imports)."""
    global _scan_path, _scanned
    path = tuple(sys.path)
    if _scan_path != path:
        clear_entry_point_cache()
        _scanned = metadata.entry_points()
        _scan_path = path
    if group not in _by_group:
        _by_group[group] = tuple(_wrap(ep) for ep in _scanned.select(group=group))
    return list(_by_group[group])


def scan_generation() -> int:
    """A number that changes whenever the scan of installed entry points is forgotten; anything derived from the
    scan (the model families' specs) is valid while it stays the same. Call after :func:`discover_entry_points`."""
    return _generation


def _wrap(ep: metadata.EntryPoint) -> PluginEntryPoint:
    return PluginEntryPoint(name=ep.name, value=ep.value, _entry_point=ep)


def import_user_dir(user_dir: str | Path) -> ModuleType:
    """Import ``user_dir`` as a package named after the directory.

    Importing the same directory again returns the module already imported, so
    this is safe to call in every spawned worker. A directory whose name clashes
    with another importable module is refused rather than shadowing it.
    """
    path = Path(user_dir).expanduser().resolve()
    if not path.is_dir():
        raise PluginLoadError(f"--user-dir {user_dir}: no such directory")
    init_file = path / "__init__.py"
    if not init_file.is_file():
        raise PluginLoadError(
            f"--user-dir {user_dir} is not a Python package: add an __init__.py that imports your plugin modules"
        )
    name = path.name
    if not name.isidentifier():
        raise PluginLoadError(
            f"--user-dir {user_dir}: '{name}' is not a valid Python package name; rename the directory"
        )
    existing = sys.modules.get(name)
    if existing is not None:
        if _module_dir(existing) == path:
            return existing
        raise PluginLoadError(
            f"--user-dir {user_dir}: a module named '{name}' is already imported from {_module_dir(existing)}; "
            f"rename your plugin directory"
        )
    installed = importlib.util.find_spec(name)
    if installed is not None and _spec_dir(installed) != path:
        raise PluginLoadError(
            f"--user-dir {user_dir}: the name '{name}' clashes with the installed module at "
            f"{_spec_dir(installed)}; rename your plugin directory"
        )
    spec = importlib.util.spec_from_file_location(name, init_file, submodule_search_locations=[str(path)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - report any plugin failure on one line
        for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[loaded]
        if isinstance(exc, PluginLoadError):
            raise
        raise PluginLoadError(
            f"--user-dir {user_dir}: importing package '{name}' failed: {type(exc).__name__}: {exc}"
        ) from exc
    return module


def _module_dir(module: ModuleType) -> Path | None:
    file = getattr(module, "__file__", None)
    if file is None:
        paths = list(getattr(module, "__path__", []))
        return Path(paths[0]).resolve() if paths else None
    return Path(file).resolve().parent


def _spec_dir(spec: importlib.machinery.ModuleSpec) -> Path | None:
    if spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0]).resolve()
    if spec.origin and spec.origin not in ("built-in", "frozen"):
        return Path(spec.origin).resolve().parent
    return None

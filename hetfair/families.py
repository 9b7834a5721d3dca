"""Model families: one :class:`FamilySpec` per family, registered by one ``hetfair.families`` entry point.

A family (hetfair's ``bert``, ``classification``, ``lm``, ``hf_encoder``, or a plugin's) is a folder plus one
line: ``name = package.family:FAMILY``, naming a :class:`FamilySpec`. The spec lists the family's tasks,
models, architectures and criteria as lazy ``"module:attr"`` references, so the registries list their names
by importing the spec's own (small) module only; a component's module is imported when its name is chosen,
as with a per-component entry point (``hetfair.tasks``, ``hetfair.models``, ...), which still works.
``hetfair-preprocess`` offers the tasks of the families that have a preprocessor, ``hetfair-export``
calls the exporter of the checkpoint's model's family.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from importlib import metadata
from types import MappingProxyType
from typing import Any, Callable, Mapping

from hetfair.errors import ComponentNotKnownError, DuplicateComponentError, PluginLoadError
from hetfair.plugins import PluginEntryPoint, discover_entry_points, scan_generation

FAMILY_GROUP = "hetfair.families"
COMPONENT_GROUPS: Mapping[str, str] = MappingProxyType({
    "hetfair.tasks": "tasks", "hetfair.models": "models", "hetfair.archs": "archs", "hetfair.criteria": "criteria"})
"""The entry-point group of each kind of component -> the :class:`FamilySpec` field that lists them."""


@dataclass(frozen=True)
class FamilySpec:
    """What a model family brings, every part named by a ``"module:attr"`` reference imported only when used.

    Attributes:
        name: the family's name (``--list-plugins``, messages).
        tasks, models, archs, criteria: component name -> reference to its class (an architecture: its
            ``@register_model_architecture`` function); a reference may also be a module whose import
            registers the name, as an entry point may.
        preprocessor: a module with ``build_parser()`` and ``preprocess(args)``: ``hetfair-preprocess --task T``
            for each of the family's tasks (``None``: the family's data needs no preprocessing).
        hf_exporter: ``exporter(model, outdir, task) -> str`` writing a model of the family as a Hugging Face
            directory and saying where it went (``hetfair-export --to hf``); ``None``: the family does not export.
        hf_import_flag: the model flag that starts a model from a Hugging Face directory (``--init-from-hf``).
        sharding_units: where the family's models say their sharding units
            (:meth:`~hetfair.models.HetfairModel.sharding_units`, which the strategies call).
        pipeline_stage: where the family's models say how they cut into pipeline stages
            (:meth:`~hetfair.models.HetfairModel.pipeline_stage`, which ``--ddp-backend pipeline`` calls);
            ``None``: they cannot be pipelined.
    """

    name: str
    tasks: Mapping[str, str] = field(default_factory=dict)
    models: Mapping[str, str] = field(default_factory=dict)
    archs: Mapping[str, str] = field(default_factory=dict)
    criteria: Mapping[str, str] = field(default_factory=dict)
    preprocessor: str | None = None
    hf_exporter: str | None = None
    hf_import_flag: str | None = None
    sharding_units: str | None = None
    pipeline_stage: str | None = None

    def __post_init__(self) -> None:
        for kind in COMPONENT_GROUPS.values():
            object.__setattr__(self, kind, MappingProxyType(dict(getattr(self, kind))))


@dataclass(frozen=True)
class Family:
    """A loaded :class:`FamilySpec` and the entry point that declared it."""

    spec: FamilySpec
    entry_point: PluginEntryPoint
    package: str
    """The package holding the spec's module: the family's folder."""

    @property
    def name(self) -> str:
        return self.spec.name

    def components(self, group: str) -> list[PluginEntryPoint]:
        """The spec's components of an entry-point group, as entry points of the family's distribution."""
        declared = getattr(self.spec, COMPONENT_GROUPS[group], {}) if group in COMPONENT_GROUPS else {}
        return [PluginEntryPoint(name, value, metadata.EntryPoint(name, value, group), self.name,
                                 self.entry_point.installed) for name, value in declared.items()]

    def preprocessor(self) -> Any:
        """The spec's preprocessor module (imported now)."""
        assert self.spec.preprocessor is not None
        return self.load(self.spec.preprocessor, "preprocessor")

    def hf_exporter(self) -> Callable[..., str]:
        """The spec's Hugging Face exporter (imported now)."""
        assert self.spec.hf_exporter is not None
        return self.load(self.spec.hf_exporter, "hf_exporter")

    def load(self, reference: str, part: str) -> Any:
        """What ``reference`` (``"module:attr"`` or ``"module"``), the spec's ``part``, names; a failure is one line."""
        try:
            return metadata.EntryPoint(part, reference, FAMILY_GROUP).load()
        except Exception as exc:  # noqa: BLE001 - a plugin's failure is one line naming it
            raise PluginLoadError(f"the {part} of family '{self.name}' ({reference}, from "
                                  f"{self.entry_point.describe()}) failed to import: {type(exc).__name__}: {exc}"
                                  ) from exc


class FamilyRegistry:
    """The installed model families, read from the ``hetfair.families`` entry points once per scan.

    Loading a spec imports its module only. A spec that fails to load is left out and reported
    (:meth:`failures`) where a name may be missing because of it, so it never breaks unrelated commands.
    """

    kind = "family"
    plural = "families"

    def __init__(self, group: str = FAMILY_GROUP) -> None:
        self.group = group
        self._generation: int | None = None
        self._families: list[Family] = []
        self._failures: list[str] = []
        self._components: dict[str, list[PluginEntryPoint]] = {}  # made once per scan: each reads its metadata once

    def all(self) -> list[Family]:
        """Every family that loaded, in entry-point order."""
        self._load()
        return list(self._families)

    def names(self) -> list[str]:
        return sorted({family.name for family in self.all()})

    def get(self, name: str) -> Family:
        """The family called ``name``; two of that name are an error naming both."""
        found = [family for family in self.all() if family.name == name]
        if len(found) > 1:
            raise DuplicateComponentError(f"family '{name}' is provided by several plugins: "
                                          + " and ".join(f.entry_point.describe() for f in found)
                                          + "; uninstall one of them")
        if not found:
            raise ComponentNotKnownError(f"unknown family '{name}'; known families: "
                                         f"{', '.join(self.names()) or '(none)'}")
        return found[0]

    def definitions(self, name: str) -> list[str]:
        """Where each family called ``name`` comes from (more than one is a clash)."""
        return [family.entry_point.source() for family in self.all() if family.name == name]

    def failures(self) -> list[str]:
        """One line per family entry point that did not load."""
        self._load()
        return list(self._failures)

    def components(self, group: str) -> list[PluginEntryPoint]:
        """Every family's components of an entry-point group (``hetfair.tasks``, ...), none imported."""
        families = self.all()
        if group not in self._components:
            self._components[group] = [component for family in families for component in family.components(group)]
        return list(self._components[group])

    def family_of(self, kind: str, name: str) -> Family | None:
        """The family whose spec lists ``name`` among its ``kind`` (``"tasks"``, ``"models"``, ...), if any."""
        return next((family for family in self.all() if name in getattr(family.spec, kind)), None)

    def _load(self) -> None:
        entry_points = discover_entry_points(self.group)
        if self._generation == scan_generation():
            return
        self._families, self._failures, self._components = [], [], {}
        for entry_point in entry_points:
            try:
                self._families.append(_load_family(entry_point))
            except PluginLoadError as exc:
                self._failures.append(str(exc))
        self._generation = scan_generation()


def _load_family(entry_point: PluginEntryPoint) -> Family:
    spec = entry_point.load()
    if not isinstance(spec, FamilySpec):
        raise PluginLoadError(f"family plugin {entry_point.describe()} names a {type(spec).__name__}, not a "
                              f"hetfair.families.FamilySpec; point the entry point at the spec")
    if spec.name != entry_point.name:
        raise PluginLoadError(f"family plugin {entry_point.describe()} names the spec of family '{spec.name}'; "
                              f"give the entry point the family's name")
    module = sys.modules.get(entry_point.module) or importlib.import_module(entry_point.module)
    return Family(spec, entry_point, module.__package__ or entry_point.module)


FAMILY_REGISTRY = FamilyRegistry()

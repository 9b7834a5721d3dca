"""Imports point down only: every hetfair module belongs to a layer and imports no higher layer.

The layers, top to bottom, are :data:`LAYERS`; modules of one layer may import
each other. Every ``import`` and ``from ... import`` counts, at module level and
inside functions, and so do constant ``importlib.import_module("...")`` calls and
a registry's ``builtin_modules=[...]``; only ``if TYPE_CHECKING:`` blocks are
exempt (annotations do not run). hetfair's own model families (``hetfair.bert``, ``hetfair.lm``,
``hetfair.hf_encoder``, ``hetfair.classification``) are read from the family registry
(:data:`hetfair.families.FAMILY_REGISTRY`, their ``hetfair.families`` entry points): besides the layering,
no module outside the plugin families may import them except the console scripts (``hetfair_cli``).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from hetfair.families import FAMILY_REGISTRY

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hetfair", "hetfair_cli")

# Packages the engine must not import (it finds them through their family specs); a family may build on
# another below it, as a third-party plugin may. They share one layer but those placed apart here.
PLUGIN_FAMILIES = tuple(sorted(family.package for family in FAMILY_REGISTRY.all()
                               if family.package.split(".")[0] in PACKAGES))
FAMILIES_ABOVE_THE_API = ("hetfair.classification",)  # builds on the BERT family and reads checkpoints
MAY_IMPORT_PLUGIN_FAMILIES = ("hetfair_cli",)

# Top to bottom. A name stands for a module or a whole package; "hetfair" is the
# package's own __init__ (the plugin API: hetfair.register_*), not its submodules.
LAYERS: list[tuple[str, ...]] = [
    ("hetfair_cli",),  # console scripts
    FAMILIES_ABOVE_THE_API,  # plugin families on the public API and the families below (see PLUGIN_FAMILIES)
    ("hetfair",),  # the public API: hetfair.register_*, hetfair.load_model (imported lazily)
    ("hetfair.lm.generate",),  # sampling from a checkpoint (hetfair.load_model) of the lm family
    ("hetfair.live",),  # live recovery: a training loop per membership round
    ("hetfair.run", "hetfair.evaluate", "hetfair.pretrained"),  # the training loop, hetfair-validate's program
    ("hetfair.checkpoint", "hetfair.trainer", "hetfair.run.validation",
     "hetfair.run.state", "hetfair.run.startup", "hetfair.run.config", "hetfair.memory.plan",
     "hetfair.memory.table"),  # their parts
    ("hetfair.balance", "hetfair.logging", "hetfair.data"),  # engine services
    ("hetfair.options", "hetfair.inventory"),  # the command line's options, --list-plugins
    ("hetfair.plan", "hetfair.precision.auto"),  # the automatic per-device plan: probed micro-batches, precision, backend
    tuple(f for f in PLUGIN_FAMILIES if f not in FAMILIES_ABOVE_THE_API),  # hetfair's own plugin families
    ("hetfair.tasks",),  # the Task base class
    ("hetfair.models", "hetfair.criteria", "hetfair.optim"),  # component base classes and registries
    ("hetfair.precision", "hetfair.compile"),  # autocast per process, the job's one loss scale; --compile
    ("hetfair.launch",),  # starting a job: rendezvous, launcher, supervisor, preemption
    ("hetfair.parallel",),  # in training: process context, collectives, stats, strategies, ZeRO, FSDP
    ("hetfair.registry", "hetfair.plugins", "hetfair.families"),  # the generic registry, plugin discovery, family specs
    ("hetfair.errors", "hetfair.utils", "hetfair.rng", "hetfair.data.indexed_dataset",
     "hetfair.data.preprocess_output", "hetfair.memory", "hetfair.models.deferred_init", "hetfair.cluster", "hetfair.data.batch_plan", "hetfair.data.update_shape"),  # leaves (the binary token format and preprocessing output every family shares; memory sizes; the deferred build strategies materialise from; the cluster file and GPU catalogue; the batch split, pure arithmetic the cluster plan shares)
]


@dataclass(frozen=True)
class Import:
    importer: str
    path: Path
    line: int
    target: str


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of hetfair and hetfair_cli."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


MODULES = module_files()


def is_ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def runtime_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """Every node below ``node``, except the bodies of ``if TYPE_CHECKING:`` blocks."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and is_type_checking(child.test):
            for other in child.orelse:
                yield other
                yield from runtime_nodes(other)
            continue
        yield child
        yield from runtime_nodes(child)


def resolve_from(importer: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    """Modules a ``from X import a, b`` imports: ``X.a`` where that is a module, else ``X``."""
    if node.level:
        base = importer.split(".") if is_package else importer.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    targets = [f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in MODULES]
    if len(targets) < len(node.names):
        targets.append(source)
    return targets


def constant_strings(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [elt.value for elt in node.elts if isinstance(elt, ast.Constant) and isinstance(elt.value, str)]
    return []


def imports_of(module: str, path: Path) -> Iterator[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    for node in runtime_nodes(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            targets = resolve_from(module, is_package, node)
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "import_module" and node.args:
                targets = constant_strings(node.args[0])
            targets += [s for kw in node.keywords if kw.arg == "builtin_modules" for s in constant_strings(kw.value)]
        for target in targets:
            if is_ours(target):
                yield Import(module, path, node.lineno, target)


def layer_of(module: str) -> int | None:
    """Index in LAYERS of the longest layer entry that is ``module`` or a package above it."""
    parts = module.split(".")
    for length in range(len(parts), 0, -1):
        prefix = ".".join(parts[:length])
        if prefix == "hetfair" and module != "hetfair":
            continue  # "hetfair" stands for the package's __init__ only
        for index, layer in enumerate(LAYERS):
            if prefix in layer:
                return index
    return None


def describe(index: int) -> str:
    return ", ".join(LAYERS[index])


def all_imports() -> list[Import]:
    return [imp for module, path in MODULES.items() for imp in imports_of(module, path)]


def where(imp: Import) -> str:
    return f"{imp.path.relative_to(REPO_ROOT)}:{imp.line}"


def test_every_module_has_a_layer():
    unplaced = sorted(module for module in MODULES if layer_of(module) is None)
    assert not unplaced, f"modules in no layer (add them to LAYERS in {Path(__file__).name}): {unplaced}"


def test_every_layer_entry_names_an_existing_module():
    stale = [name for layer in LAYERS for name in layer if name not in MODULES]
    assert not stale, f"LAYERS names modules that do not exist: {stale}"


def test_imports_point_down_only():
    violations = []
    for imp in all_imports():
        own, other = layer_of(imp.importer), layer_of(imp.target)
        if own is None or other is None:
            continue  # reported by test_every_module_has_a_layer (or an import of a missing module)
        if other < own:
            violations.append(f"{where(imp)}: {imp.importer} imports {imp.target} "
                              f"(layer [{describe(other)}] is above [{describe(own)}])")
    assert not violations, "imports that point up:\n" + "\n".join(violations)


def test_imports_name_existing_modules():
    missing = [f"{where(imp)}: {imp.target}" for imp in all_imports() if imp.target not in MODULES]
    assert not missing, "imports of hetfair modules that do not exist:\n" + "\n".join(missing)


def test_engine_does_not_import_plugin_families():
    def inside(module: str, packages: tuple[str, ...]) -> bool:
        return any(module == p or module.startswith(p + ".") for p in packages)

    violations = [
        f"{where(imp)}: {imp.importer} imports {imp.target}"
        for imp in all_imports()
        for family in PLUGIN_FAMILIES
        if inside(imp.target, (family,))
        and not inside(imp.importer, (*PLUGIN_FAMILIES, *MAY_IMPORT_PLUGIN_FAMILIES))
    ]
    assert not violations, ("plugin families are found through entry points, not imported:\n"
                            + "\n".join(violations))


def test_every_family_spec_in_the_tree_is_registered():
    specs = {module.rsplit(".", 1)[0] for module in MODULES if module.endswith(".family")}
    unregistered = sorted(specs - set(PLUGIN_FAMILIES))
    assert not unregistered, (f"family specs no hetfair.families entry point names: {unregistered}; add a line to "
                              f"setup.cfg's hetfair.families and reinstall (pip install -e .)")
    assert set(FAMILIES_ABOVE_THE_API) <= set(PLUGIN_FAMILIES)


def test_a_family_is_its_folder():
    def modules(spec) -> list[str]:
        references = [*spec.tasks.values(), *spec.models.values(), *spec.archs.values(), *spec.criteria.values(),
                      spec.preprocessor, spec.hf_exporter, spec.sharding_units, spec.pipeline_stage]
        return [reference.split(":")[0] for reference in references if reference]

    ours = [family for family in FAMILY_REGISTRY.all() if family.package in PLUGIN_FAMILIES]
    outside = [f"family {family.name}: {module}" for family in ours for module in modules(family.spec)
               if not module.startswith(family.package + ".")]
    missing = [f"family {family.name}: {module}" for family in ours for module in modules(family.spec)
               if module not in MODULES]
    assert not outside, f"family specs naming modules outside their folder: {outside}"
    assert not missing, f"family specs naming modules that do not exist: {missing}"


def import_cycles() -> list[list[str]]:
    """Groups of modules that import each other, directly or round a circle (Tarjan's strongly connected
    components). A package importing its own submodules (registering built-ins) is not counted."""
    graph: dict[str, set[str]] = {}
    for imp in all_imports():
        if imp.target in MODULES and imp.target != imp.importer and not imp.target.startswith(imp.importer + "."):
            graph.setdefault(imp.importer, set()).add(imp.target)
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            group = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in sorted(MODULES):
        if module not in order:
            visit(module)
    return cycles


def test_no_import_cycles():
    assert not import_cycles(), f"modules that import each other (in functions too): {import_cycles()}"


LAYOUT_PAGE = REPO_ROOT / "docs" / "layout.md"


def without_parentheses(text: str) -> str:
    """``text`` without its parenthesised remarks (nested ones, such as a link's target, included)."""
    kept, depth = [], 0
    for char in text:
        depth += char == "("
        if depth == 0:
            kept.append(char)
        depth -= char == ")" and depth > 0
    return "".join(kept)


def documented_layers(page: str) -> list[tuple[str, ...]]:
    """The numbered list after "The layers, top to bottom" on docs/layout.md: each item's `names`, its
    parenthesised remarks left out."""
    items: list[str] = []
    for line in page.split("The layers, top to bottom", 1)[1].splitlines():
        if re.match(r"\d+\. ", line):
            items.append(line.split(". ", 1)[1])
        elif items and line.startswith("   ") and line.strip():
            items[-1] += " " + line.strip()
        elif items and not line.strip():
            break
    return [tuple(re.findall(r"`([^`]+)`", without_parentheses(item))) for item in items]


def test_the_layout_page_lists_the_layers():
    documented = documented_layers(LAYOUT_PAGE.read_text())
    rows = max(len(documented), len(LAYERS))
    page = [set(layer) for layer in documented] + [set()] * (rows - len(documented))
    code = [set(layer) for layer in LAYERS] + [set()] * (rows - len(LAYERS))
    wrong = [f"  {index + 1}. the page: {', '.join(sorted(p)) or '-'} | LAYERS: {', '.join(sorted(c)) or '-'}"
             for index, (p, c) in enumerate(zip(page, code)) if p != c]
    expected = "\n".join(f"{index + 1}. " + ", ".join(f"`{name}`" for name in layer)
                         for index, layer in enumerate(LAYERS))
    assert not wrong, (
        f"docs/layout.md's numbered layer list differs from LAYERS in {Path(__file__).name} (each item names its "
        f"layer's modules in backquotes, layers in LAYERS' order; remarks in parentheses are free):\n"
        + "\n".join(wrong) + f"\nthe list as LAYERS has it:\n{expected}")

"""The option namespace stops at the edge: the training engine reads typed configs, never ``args``.

The command line parses the options; :mod:`hetfair.run.wiring` (and the checks and entry point of
:mod:`hetfair.run.training`) builds the components from them, as plugins expect, and one
:class:`~hetfair.run.config.RunConfig` of typed sections. Below that nothing reads the namespace: a
walk over every engine module finds no ``args.x``, ``getattr(args, ...)`` or ``vars(args)`` outside the
edge and the typed configs' own ``from_args`` (their translation from the flags, called only at the edge;
a helper of one is named ``..._from_args`` too).
"""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path
from typing import Iterator

REPO_ROOT = Path(__file__).resolve().parents[1]
ENGINE = ("hetfair/run", "hetfair/trainer.py", "hetfair/checkpoint", "hetfair/balance.py", "hetfair/precision",
          "hetfair/parallel", "hetfair/memory", "hetfair/plan")
NAMESPACE_NAMES = {"args", "options", "namespace"}
EDGE_MODULES = {"hetfair/run/wiring.py"}
"""Modules that are the edge as a whole."""
EDGE_FUNCTIONS = {("hetfair/run/training.py", "check_before_start"), ("hetfair/run/training.py", "train")}
"""Functions that are the edge: the checks before any process starts, and the launcher's entry point."""
CONFIG_BUILDERS = {"hetfair/run/config.py", "hetfair/run/wiring.py", "hetfair/run/training.py"}
"""Where the engine turns flags into typed configs (``X.from_args(args)``)."""
TRAINING_RUN_MAX_LINES = 250


def engine_files() -> list[Path]:
    files: list[Path] = []
    for entry in ENGINE:
        path = REPO_ROOT / entry
        files.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return files


def _relative(path: Path) -> str:
    return path.relative_to(REPO_ROOT).as_posix()


def _scopes(tree: ast.Module) -> Iterator[tuple[list[str], ast.AST]]:
    """Every node with the names of the functions and classes around it, innermost last."""
    def walk(node: ast.AST, names: list[str]) -> Iterator[tuple[list[str], ast.AST]]:
        for child in ast.iter_child_nodes(node):
            inner = names + [child.name] if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                ast.ClassDef)) else names
            yield inner, child
            yield from walk(child, inner)
    return walk(tree, [])


def _reads_namespace(node: ast.AST) -> bool:
    """``args.x``, ``getattr(args, ...)``, ``vars(args)`` or ``self.args`` / ``self._args``."""
    if isinstance(node, ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id in NAMESPACE_NAMES:
            return True
        return node.attr in {"args", "_args"} and isinstance(node.value, ast.Name) and node.value.id == "self"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in {"getattr", "vars"}:
        return bool(node.args) and isinstance(node.args[0], ast.Name) and node.args[0].id in NAMESPACE_NAMES
    return False


def _allowed(path: str, scope: list[str]) -> bool:
    if path in EDGE_MODULES or (scope and scope[-1].endswith("from_args")):
        return True
    return any((path, name) in EDGE_FUNCTIONS for name in scope)


def namespace_reads() -> list[str]:
    found = []
    for path in engine_files():
        relative = _relative(path)
        for scope, node in _scopes(ast.parse(path.read_text(), str(path))):
            if _reads_namespace(node) and not _allowed(relative, scope):
                found.append(f"{relative}:{node.lineno} in {'.'.join(scope) or 'module'}: {ast.unparse(node)}")
    return found


def test_the_engine_reads_no_option_namespace_below_the_edge():
    assert namespace_reads() == []


def test_typed_configs_are_built_from_the_options_only_at_the_edge():
    builders = []
    for path in engine_files():
        relative = _relative(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "from_args" \
                    and relative not in CONFIG_BUILDERS:
                builders.append(f"{relative}:{node.lineno}: {ast.unparse(node)}")
    assert builders == []


def test_the_walk_sees_a_namespace_read():
    """The check above would fail: each form of reading the namespace is found."""
    for source in ("args.lr", "getattr(args, 'lr', 0)", "vars(args)", "self.args.lr", "self._args"):
        assert any(_reads_namespace(node) for node in ast.walk(ast.parse(source))), source
    assert not any(_reads_namespace(node) for node in ast.walk(ast.parse("config.loop.max_update")))


def test_the_options_the_checkpoint_keeps_carry_the_plans_choices_in_place_of_auto():
    """The planner returns a RunConfig; the options stored in checkpoints (plain data) still read as before:
    the chosen micro-batch, backend and shard fractions, every other option as typed."""
    from helpers import TOY_PLUGIN

    from hetfair.options import parse_train_args
    from hetfair.run.config import RunConfig
    from hetfair.run.wiring import planned_options

    args = parse_train_args(["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--max-sentences", "auto",
                             "--memory-budget", "1G", "--max-update", "1"])
    given = RunConfig.from_args(args, world_size=2)
    planned = replace(given, data=replace(given.data, max_sentences=12),
                      parallel=replace(given.parallel, ddp_backend="fully_sharded", shard_fractions=(0.25, 0.75)))
    options = planned_options(args, given, planned)
    assert (options.max_sentences, options.ddp_backend, options.shard_fractions) == (12, "fully_sharded", "0.25,0.75")
    assert vars(options) == {**vars(args), "max_sentences": 12, "ddp_backend": "fully_sharded",
                             "shard_fractions": "0.25,0.75"}
    assert vars(planned_options(args, given, given)) == vars(args)  # nothing auto: the options as typed


def test_training_run_is_small_and_split_into_wiring_loop_and_reporting():
    tree = ast.parse((REPO_ROOT / "hetfair/run/training.py").read_text())
    run = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "TrainingRun")
    assert run.end_lineno is not None and run.end_lineno - run.lineno + 1 < TRAINING_RUN_MAX_LINES
    from hetfair.run.loop import TrainingLoop
    from hetfair.run.reporting import RunReports
    from hetfair.run.training import TrainingRun
    from hetfair.run.wiring import RunWiring

    assert issubclass(TrainingRun, TrainingLoop) and issubclass(TrainingLoop, RunReports)
    assert callable(RunWiring.build_components) and callable(RunWiring.plan) and callable(RunWiring.build_trainer)

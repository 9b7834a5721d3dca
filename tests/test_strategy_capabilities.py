"""Code outside ``hetfair/parallel/`` asks a strategy what it can do, never which mode it is.

Live recovery, the plan, the memory plan and the options read a strategy's declarations
(:class:`hetfair.parallel.Strategy`: ``live_recovery_refusal``, ``plan_role``, ``takes_shard_fractions``,
``takes_shard_weights``, ``owned_flags``). A source scan finds any mode name compared or listed outside the
strategies; the toys of ``tests/toy_plugin/capabilities.py`` show that a plugin's declarations are all the
rest of hetfair needs.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path
from typing import Iterator

import pytest

from hetfair.errors import ConfigError
from hetfair.live.recovery import check_live_options, live_recovery_refusal
from hetfair.memory.plan import complete_parallel_config
from hetfair.options import parse_train_args
from hetfair.parallel import STRATEGY_REGISTRY, ParallelConfig, Strategy, plan_candidate, plan_candidates
from hetfair.plan.planner import JobPlan, RankPlan
from hetfair.plugins import import_user_dir
from hetfair.registry import Registry
from toy_reference import TOY_PLUGIN, toy_train_args

REPO = Path(__file__).resolve().parents[1]
STRATEGIES = REPO / "hetfair" / "parallel"
MODE_SETTINGS = {"ddp_backend", "zero_sharding"}
"""Configuration fields that name a mode: compared with any string, they ask which mode runs."""
G = 1 << 30
LIVE = ("--fault-tolerance", "live", "--distributed-world-size", "2", "--distributed-init-method", "tcp://127.0.0.1:1")


def builtin_strategy_names() -> set[str]:
    return {name for name in STRATEGY_REGISTRY.names() if STRATEGY_REGISTRY.source(name).startswith("built-in")}


def _strings(node: ast.AST) -> list[str]:
    """The string constants ``node`` is, or holds as the elements of a tuple, list or set or the keys of a dict."""
    if isinstance(node, ast.Constant):
        return [node.value] if isinstance(node.value, str) else []
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [string for element in node.elts for string in _strings(element)]
    if isinstance(node, ast.Dict):
        return [string for key in node.keys if key is not None for string in _strings(key)]
    return []


def _names_a_mode(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr in MODE_SETTINGS


def mode_name_tests(source: str, names: set[str]) -> list[tuple[int, str]]:
    """``(line, name)`` for each place in ``source`` that asks a mode by name: one of ``names`` compared (``==``,
    ``!=``, ``in``, ``not in``) or held in a tuple, list, set or dict literal or used as a subscript, and any
    string compared with a field of :data:`MODE_SETTINGS`. Docstrings, help texts and defaults are none of these."""
    found: set[tuple[int, str]] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            asks_mode = any(_names_a_mode(operand) for operand in operands)
            found |= {(node.lineno, string) for operand in operands for string in _strings(operand)
                      if asks_mode or string in names}
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
            found |= {(node.lineno, string) for string in _strings(node) if string in names}
        elif isinstance(node, ast.Subscript):
            found |= {(node.lineno, string) for string in _strings(node.slice) if string in names}
    return sorted(found)


SAMPLE = '''
"""A module docstring naming c10d and fully_sharded."""
def choose(config, name, parser):
    """c10d, diloco"""
    parser.add_argument("--ddp-backend", default="c10d", help="fully_sharded shards the state")
    if config.ddp_backend == "fully_sharded":
        pass
    if "diloco" != name or name in ("c10d", "localsgd"):
        pass
    if config.zero_sharding != "none":
        pass
    return {"hybrid_sharded": "why"}[name], WHY["localsgd"], config.ddp_backend == AUTO, "c10d".upper()
'''


def test_the_scan_finds_mode_names_compared_or_listed_and_not_those_in_text():
    names = {"c10d", "fully_sharded", "hybrid_sharded", "localsgd", "diloco"}
    assert mode_name_tests(SAMPLE, names) == [(6, "fully_sharded"), (8, "c10d"), (8, "diloco"), (8, "localsgd"),
                                              (10, "none"), (12, "hybrid_sharded"), (12, "localsgd")]


def test_no_code_outside_the_strategies_compares_a_mode_name():
    names = builtin_strategy_names()
    assert {"c10d", "fully_sharded", "hybrid_sharded", "localsgd", "diloco"} <= names
    files = [path for root in ("hetfair", "hetfair_cli") for path in sorted((REPO / root).rglob("*.py"))
             if STRATEGIES not in path.parents]
    found = [f"{path.relative_to(REPO)}:{line}: {name!r}" for path in files
             for line, name in mode_name_tests(path.read_text(), names)]
    assert not found, "ask the strategy (a class attribute or method) instead of its name:\n" + "\n".join(found)


@pytest.fixture
def toys(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The strategies of ``tests/toy_plugin/capabilities.py``, registered for this test only."""
    import_user_dir(TOY_PLUGIN)
    STRATEGY_REGISTRY.names()  # the built-ins registered before the copy
    monkeypatch.setattr(STRATEGY_REGISTRY, "_entries", dict(STRATEGY_REGISTRY._entries))  # restored after the test
    importlib.import_module("toy_plugin.capabilities")
    yield
    sys.modules.pop("toy_plugin.capabilities", None)


def test_live_recovery_keeps_or_refuses_a_plugin_strategy_as_it_declares(tmp_path, toys):
    assert live_recovery_refusal(ParallelConfig("toy_whole")) is None
    assert live_recovery_refusal(ParallelConfig("toy_fractions")) == (
        "--ddp-backend toy_fractions: a lost rank's shard is kept nowhere else; use --ddp-backend c10d, or "
        "--fault-tolerance none with torchrun's restarts")
    check_live_options(parse_train_args(toy_train_args(tmp_path, None, (*LIVE, "--ddp-backend", "toy_whole"))))
    with pytest.raises(ConfigError, match="^--fault-tolerance live does not support --ddp-backend toy_fractions: "):
        check_live_options(parse_train_args(toy_train_args(tmp_path, None, (*LIVE, "--ddp-backend", "toy_fractions"))))


def test_live_recovery_refuses_auto_for_the_sharded_strategy_it_may_choose():
    assert live_recovery_refusal(ParallelConfig("auto")) == (
        "--ddp-backend auto, which may choose --ddp-backend fully_sharded: a lost rank's parameter shards cannot be "
        "rebuilt from the others; use --ddp-backend c10d, or --fault-tolerance none with torchrun's restarts")
    assert live_recovery_refusal(ParallelConfig("c10d", zero_sharding="os")).startswith("--zero-sharding os: ")


def test_auto_chooses_the_built_in_roles_and_a_plugin_for_a_role_no_built_in_declares(toys):
    assert plan_candidates() == ["c10d", "fully_sharded"]
    plugins_only: Registry[type[Strategy]] = Registry("strategy", Strategy)
    plugins_only.add("toy_allreduce", STRATEGY_REGISTRY.get("toy_allreduce"))  # declares no role
    with pytest.raises(ConfigError, match="needs a strategy whose plan_role is 'replicated'"):
        plan_candidate("replicated", plugins_only)
    for name in ("toy_whole", "toy_fractions"):
        plugins_only.add(name, STRATEGY_REGISTRY.get(name))
    assert plan_candidates(plugins_only) == ["toy_whole", "toy_fractions"]


def _shard_column(backend: str, fractions: tuple[float, ...] | None = None) -> list[str]:
    row = RankPlan("cpu", None, None, "fp32", None, "given (--max-sentences 4)")
    table = JobPlan([row, row], backend, "as given", fractions, False).lines([4, 4], [0.5, 0.5])
    return [line.split("|")[8].strip() for line in table[1:3]]


@pytest.mark.parametrize("backend, fractions, shown", [
    ("c10d", None, ["whole", "whole"]),
    ("fully_sharded", (0.25, 0.75), ["0.25", "0.75"]),
    ("fully_sharded", None, ["0.50", "0.50"]),
    ("hybrid_sharded", None, ["-", "-"]),
    ("diloco", None, ["-", "-"]),
    ("toy_whole", None, ["whole", "whole"]),
    ("toy_fractions", (0.25, 0.75), ["0.25", "0.75"]),
    ("toy_allreduce", None, ["-", "-"]),
])
def test_the_plan_table_shows_the_share_each_strategy_declares(toys, backend, fractions, shown):
    assert _shard_column(backend, fractions) == shown


def test_budgets_fill_in_the_shares_a_plugin_strategy_declares(toys):
    def complete(config: ParallelConfig) -> ParallelConfig:
        return complete_parallel_config(config, [6 * G, 18 * G], [False, False], lambda line: None)

    assert complete(ParallelConfig("toy_fractions")).shard_fractions == (0.25, 0.75)
    assert complete(ParallelConfig("toy_whole")) == ParallelConfig("toy_whole")
    assert complete(ParallelConfig("toy_whole", zero_sharding="os")).zero_shard_weights is None  # not its option
    assert complete(ParallelConfig("c10d", zero_sharding="os")).zero_shard_weights == f"{6 * G},{18 * G}"


def test_options_take_the_flags_a_plugin_strategy_declares(tmp_path, toys):
    given = ("--shard-fractions", "1,3")
    assert parse_train_args(toy_train_args(tmp_path, None, ("--ddp-backend", "toy_fractions", *given))).shard_fractions \
        == "1,3"
    with pytest.raises(ConfigError, match=r"^--shard-fractions needs --ddp-backend fully_sharded or toy_fractions "
                                          r"\(this command has --ddp-backend toy_whole\)"):
        parse_train_args(toy_train_args(tmp_path, None, ("--ddp-backend", "toy_whole", *given)))
    with pytest.raises(ConfigError, match="^--ddp-backend auto may choose fully_sharded: --find-unused-parameters"):
        parse_train_args(toy_train_args(tmp_path, None, ("--ddp-backend", "auto", "--find-unused-parameters")))


def test_a_plugin_strategy_without_a_cost_formula_is_not_ranked(toys):
    """hetfair-plan weighs only the modes that declare cost variants, and --ddp-backend auto, given a plugin
    candidate without a formula, ranks nothing (it chooses by memory, as before the cost model)."""
    from hetfair.cluster.description import Link
    from hetfair.parallel.cost_model import ModelCost
    from hetfair.plan.cluster_plan import predict_all
    from hetfair.plan.predicted import measured_cluster, predict_candidates

    fact = {"memory": 4e10, "precision": "fp32", "seconds_per_sample": 0.01, "step_overhead": 0.0,
            "flops_per_sample": 1e9, "device": "cpu", "batch": 8}
    cluster = measured_cluster([{**fact, "node": node} for node in "ab"], Link(1.25e8, 5e-5))
    model = ModelCost(1_000_000, 1e9, 1_000, 2.0, 2, 1_000_000)
    assert predict_candidates(cluster, model, [8, 8], ["toy_whole", "toy_fractions"], None) == []
    assert predict_candidates(cluster, model, [8, 8], ["c10d", "fully_sharded"], None)  # the built-ins have one
    assert {p.backend for p in predict_all(cluster, model, 16)} == {"c10d", "fully_sharded", "diloco"}

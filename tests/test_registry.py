"""The generic registry: decorator registration, type checks, duplicates, lookups."""

from __future__ import annotations

import importlib
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

import hetfair
from hetfair import errors
from hetfair.criteria import CRITERION_REGISTRY, HetfairCriterion
from hetfair.models import ARCH_REGISTRY, MODEL_REGISTRY, HetfairModel, arch_names, resolve_arch
from hetfair.optim import LR_SCHEDULER_REGISTRY, OPTIMIZER_REGISTRY, HetfairOptimizer, LRScheduler
from hetfair.registry import Registry
from hetfair.tasks import TASK_REGISTRY, Task

# (kind, public decorator factory, registry, required base class)
KINDS = [
    ("task", hetfair.register_task, TASK_REGISTRY, Task),
    ("model", hetfair.register_model, MODEL_REGISTRY, HetfairModel),
    ("criterion", hetfair.register_criterion, CRITERION_REGISTRY, HetfairCriterion),
    ("optimizer", hetfair.register_optimizer, OPTIMIZER_REGISTRY, HetfairOptimizer),
    ("lr_scheduler", hetfair.register_lr_scheduler, LR_SCHEDULER_REGISTRY, LRScheduler),
]
KIND_IDS = [kind for kind, *_ in KINDS]


def unique(prefix: str) -> str:
    """A registry name no other test uses (the global registries live for the whole session)."""
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def import_fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, code: str):
    """Write ``module.py`` under ``tmp_path`` and import it for real."""
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(code))
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(module)


@pytest.mark.parametrize("kind, register, registry, base", KINDS, ids=KIND_IDS)
def test_public_decorator_registers_each_kind(kind, register, registry, base):
    name = unique(f"test_{kind}")

    class Component(base):
        pass

    assert register(name)(Component) is Component
    assert name in registry.names()
    assert registry.get(name) is Component
    assert registry.source(name) == f"user code ({__name__}.{Component.__qualname__})"


def test_register_model_architecture_maps_arch_to_model_and_defaults():
    model_name, arch = unique("test_model"), unique("test_arch")

    @hetfair.register_model(model_name)
    class Model(HetfairModel):
        pass

    @hetfair.register_model_architecture(model_name, arch)
    def tiny() -> dict:
        return {"hidden_dim": 4}

    assert arch in ARCH_REGISTRY.names()
    assert {arch, model_name} <= set(arch_names())
    assert resolve_arch(arch) == (model_name, {"hidden_dim": 4})
    assert resolve_arch(model_name) == (model_name, {}), "a model is its own architecture"


@pytest.mark.parametrize("kind, register, registry, base", KINDS, ids=KIND_IDS)
def test_wrong_base_class_is_refused(kind, register, registry, base):
    name = unique(f"test_{kind}")

    class NotAComponent:
        pass

    with pytest.raises(errors.ComponentTypeError) as caught:
        register(name)(NotAComponent)
    message = str(caught.value)
    assert f"'{name}'" in message
    assert "NotAComponent" in message
    assert f"{base.__module__}.{base.__qualname__}" in message
    assert name not in registry.names()


def test_function_is_refused_where_a_class_is_required():
    name = unique("test_task")
    with pytest.raises(errors.ComponentTypeError):
        hetfair.register_task(name)(lambda args: None)
    assert name not in TASK_REGISTRY.names()


def test_architecture_must_be_callable():
    arch = unique("test_arch")
    with pytest.raises(errors.ComponentTypeError, match="not callable"):
        hetfair.register_model_architecture("some_model", arch)({"hidden_dim": 4})
    assert arch not in ARCH_REGISTRY.names()


def test_duplicate_name_names_both_definitions_and_keeps_the_first():
    name = unique("test_task")

    @hetfair.register_task(name)
    class First(Task):
        pass

    class Second(Task):
        pass

    with pytest.raises(errors.DuplicateComponentError) as caught:
        hetfair.register_task(name)(Second)
    message = str(caught.value)
    assert f"{__name__}.{First.__qualname__}" in message
    assert f"{__name__}.{Second.__qualname__}" in message
    assert TASK_REGISTRY.get(name) is First


def test_duplicate_across_modules_names_module_and_class(tmp_path, monkeypatch):
    suffix = uuid.uuid4().hex[:8]
    code = """
        from hetfair.tasks import Task

        class {cls}(Task):
            pass
    """
    first = import_fresh(tmp_path, monkeypatch, f"dup_a_{suffix}", code.format(cls="AlphaTask"))
    second = import_fresh(tmp_path, monkeypatch, f"dup_b_{suffix}", code.format(cls="BetaTask"))
    registry: Registry = Registry("task", Task)
    registry.register("shared")(first.AlphaTask)
    with pytest.raises(errors.DuplicateComponentError) as caught:
        registry.register("shared")(second.BetaTask)
    assert f"dup_a_{suffix}.AlphaTask" in str(caught.value)
    assert f"dup_b_{suffix}.BetaTask" in str(caught.value)


def test_module_imported_twice_re_registers_harmlessly(tmp_path, monkeypatch):
    module, name = f"reimport_{uuid.uuid4().hex[:8]}", unique("test_task")
    code = f"""
        import hetfair
        from hetfair.tasks import Task

        @hetfair.register_task("{name}")
        class ReimportedTask(Task):
            pass
    """
    first = import_fresh(tmp_path, monkeypatch, module, code)
    del sys.modules[module]  # what a second import (e.g. in a spawned worker) does
    second = importlib.import_module(module)

    assert second.ReimportedTask is not first.ReimportedTask
    assert TASK_REGISTRY.get(name) is second.ReimportedTask
    assert TASK_REGISTRY.names().count(name) == 1


def test_unknown_name_lists_known_names():
    registry: Registry = Registry("widget", None)
    registry.add("beta", lambda: None)
    registry.add("alpha", lambda: None)
    with pytest.raises(errors.ComponentNotKnownError) as caught:
        registry.get("gamma")
    assert str(caught.value) == "unknown widget 'gamma'; known widgets: alpha, beta"


def test_unknown_arch_lists_archs_and_models():
    model_name = unique("test_model")
    hetfair.register_model(model_name)(type("ListedModel", (HetfairModel,), {}))
    with pytest.raises(errors.ComponentNotKnownError) as caught:
        resolve_arch("no_such_arch")
    assert "unknown arch 'no_such_arch'" in str(caught.value)
    assert model_name in str(caught.value)


def test_builtins_are_registered_and_reported_as_built_in():
    assert "cross_entropy" in CRITERION_REGISTRY.names()
    assert {"adam", "adamw", "sgd"} <= set(OPTIMIZER_REGISTRY.names())
    assert {"fixed", "polynomial_decay", "inverse_sqrt", "cosine"} <= set(LR_SCHEDULER_REGISTRY.names())
    assert CRITERION_REGISTRY.source("cross_entropy").startswith("built-in (hetfair.criteria.")


@pytest.mark.parametrize(
    "error",
    [errors.ComponentNotKnownError, errors.DuplicateComponentError, errors.ComponentTypeError,
     errors.PluginLoadError, errors.ConfigError],
)
def test_registry_errors_are_user_errors_with_exit_code_2(error):
    assert issubclass(error, errors.HetfairError)
    assert error("x").exit_code == 2


@pytest.mark.parametrize("register, base, flag", [
    (hetfair.register_strategy, "Strategy", "--ddp-backend auto"),
    (hetfair.register_comm_hook, "CommHook", "--ddp-comm-hook auto"),
], ids=["strategy", "comm hook"])
def test_auto_is_reserved_where_it_asks_hetfair_to_choose(register, base, flag):
    from hetfair import parallel

    class Named(getattr(parallel, base)):
        pass

    with pytest.raises(errors.ComponentTypeError) as caught:
        register("auto")(Named)
    message = str(caught.value)
    assert "'auto' is reserved" in message and flag in message and "choose another name" in message
    registry = parallel.STRATEGY_REGISTRY if base == "Strategy" else parallel.COMM_HOOK_REGISTRY
    assert "auto" not in registry.names()

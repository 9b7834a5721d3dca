"""Plugin discovery: ``--user-dir`` packages and entry points of installed distributions.

Entry points come from real ``*.dist-info`` metadata written under ``tmp_path``
and put on ``sys.path`` (in process) or ``PYTHONPATH`` (for the command line).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from forked_cli import run_forked
from hetfair import errors
from hetfair.options import parse_train_args
from hetfair.plugins import import_user_dir
from hetfair.registry import Registry
from hetfair.tasks import TASK_REGISTRY, Task
from hetfair_cli.train import main


def suffix() -> str:
    return uuid.uuid4().hex[:8]


def write_package(root: Path, name: str, init_code: str) -> Path:
    """A ``--user-dir`` package ``root/name`` whose ``__init__.py`` is ``init_code``."""
    package = root / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(init_code))
    return package


def write_distribution(root: Path, dist: str, entry_points: dict[str, dict[str, str]],
                       modules: dict[str, str]) -> Path:
    """Installed-looking metadata (``dist-info`` with entry points) plus plugin modules under ``root``."""
    info = root / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = []
    for group, points in entry_points.items():
        lines += [f"[{group}]"] + [f"{name} = {value}" for name, value in points.items()] + [""]
    (info / "entry_points.txt").write_text("\n".join(lines))
    for module, code in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(code))
    return root


def command_env(pythonpath: Path | None, env: dict[str, str] | None) -> dict[str, str]:
    """This process's environment with ``env``, ``pythonpath`` first on ``PYTHONPATH``, and no ``HETFAIR_DEBUG``."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("HETFAIR_DEBUG", None)
    if pythonpath is not None:
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), full_env.get("PYTHONPATH")]))
    return full_env


def run_script(*argv: str, pythonpath: Path | None = None, env: dict[str, str] | None = None,
               cwd: Path) -> subprocess.CompletedProcess:
    """Run the installed ``hetfair-train`` console script (a fresh interpreter)."""
    script = Path(sys.executable).with_name("hetfair-train")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "hetfair_cli.train"]
    return subprocess.run(command + list(argv), check=False, capture_output=True, text=True,
                          env=command_env(pythonpath, env), cwd=cwd, timeout=120)


def run_train(*argv: str, pythonpath: Path | None = None, env: dict[str, str] | None = None,
              cwd: Path) -> subprocess.CompletedProcess:
    """Run ``hetfair-train``'s main as a process of its own forked from the tests' pre-imported interpreter
    (:mod:`forked_cli`: ``PYTHONPATH`` goes first on its ``sys.path``), without a torch import per command."""
    [result] = run_forked([list(argv)], cwd, command_env(pythonpath, env), timeout=120)
    return result


def assert_one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("hetfair-train: error: ")
    return lines[0]


# -- --user-dir ------------------------------------------------------------------

USER_TASK = """
    import hetfair
    from hetfair.tasks import Task

    @hetfair.register_task("{task}")
    class UserTask(Task):
        option_defaults = {{"arch": "{task}_model", "max_sentences": 2}}

        @staticmethod
        def add_args(parser):
            parser.add_argument("--user-dir-task-flag", type=int, default=5, help="flag of the user task")

    @hetfair.register_model("{task}_model")
    class UserModel(hetfair.models.HetfairModel):
        pass
"""


@pytest.fixture
def user_dir(tmp_path: Path) -> tuple[Path, str]:
    """A fresh user-dir package (unique package and task names) and its task name."""
    task = f"user_task_{suffix()}"
    return write_package(tmp_path, f"user_plugins_{suffix()}", USER_TASK.format(task=task)), task


def test_user_dir_task_is_a_valid_task_choice(user_dir):
    package, task = user_dir
    args = parse_train_args(["--user-dir", str(package), "--task", task, "--user-dir-task-flag", "7"])
    assert args.task == task
    assert args.model == f"{task}_model"
    assert args.user_dir_task_flag == 7


def test_user_dir_task_flags_show_in_help(user_dir, capsys):
    package, task = user_dir
    with pytest.raises(SystemExit) as caught:
        main(["--user-dir", str(package), "--task", task, "--help"])
    assert caught.value.code == 0
    out = capsys.readouterr().out
    assert f"task '{task}'" in out
    assert "--user-dir-task-flag" in out


def test_user_dir_imported_twice_is_harmless(user_dir):
    package, task = user_dir
    first = import_user_dir(package)
    assert import_user_dir(package) is first
    assert parse_train_args(["--user-dir", str(package), "--task", task]).task == task


def test_user_dir_reimported_from_scratch_re_registers_harmlessly(user_dir):
    package, task = user_dir
    first = import_user_dir(package)
    del sys.modules[package.name]  # a spawned worker imports the package afresh
    second = import_user_dir(package)
    assert second is not first
    assert TASK_REGISTRY.get(task) is second.UserTask


def _missing(tmp_path: Path) -> tuple[Path, str]:
    return tmp_path / "does_not_exist", "no such directory"


def _no_init(tmp_path: Path) -> tuple[Path, str]:
    (tmp_path / "loose_modules").mkdir()
    (tmp_path / "loose_modules" / "task.py").write_text("")
    return tmp_path / "loose_modules", "is not a Python package"


def _raising(tmp_path: Path) -> tuple[Path, str]:
    package = write_package(tmp_path, "raising_plugins", "raise ValueError('bad plugin setting')\n")
    return package, "importing package 'raising_plugins' failed: ValueError: bad plugin setting"


def _clashing(tmp_path: Path) -> tuple[Path, str]:
    return write_package(tmp_path, "json", "\n"), "'json'"


def _shadows_installed(tmp_path: Path) -> tuple[Path, str]:
    # a standard-library module nothing imports at start-up: found on sys.path, not yet in sys.modules
    return write_package(tmp_path, "tabnanny", "\n"), "the name 'tabnanny' clashes with the installed module"


def _bad_name(tmp_path: Path) -> tuple[Path, str]:
    return write_package(tmp_path, "my-plugins", "\n"), "not a valid Python package name"


# "raises" runs the installed script: a fresh interpreter turns the plugin's exception into one line too
@pytest.mark.parametrize("make,run", [(_missing, run_train), (_no_init, run_train), (_raising, run_script),
                                      (_clashing, run_train), (_shadows_installed, run_train),
                                      (_bad_name, run_train)],
                         ids=["missing", "no-init", "raises", "clashes-with-json", "shadows-installed", "bad-name"])
def test_bad_user_dir_is_one_error_line(tmp_path, make, run):
    package, expected = make(tmp_path)
    line = assert_one_error_line(run("--user-dir", str(package), "--list-plugins", cwd=tmp_path))
    assert "--user-dir" in line
    assert expected in line


def test_debug_flag_shows_the_traceback(tmp_path):
    package, _ = _raising(tmp_path)
    result = run_script("--user-dir", str(package), "--list-plugins", "--debug", cwd=tmp_path)
    assert result.returncode != 0
    assert "Traceback" in result.stderr
    assert "ValueError: bad plugin setting" in result.stderr


# -- entry points, in process (fresh registries, so global ones stay clean) ----------


@pytest.fixture
def fresh_group() -> str:
    return f"hetfair_test_{suffix()}.tasks"


def put_on_path(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    monkeypatch.syspath_prepend(str(root))


def test_entry_points_are_listed_without_importing(tmp_path, monkeypatch, fresh_group):
    mod_a, mod_b = f"never_a_{suffix()}", f"never_b_{suffix()}"
    write_distribution(tmp_path, "hetfair-test-listing", {fresh_group: {"alpha": f"{mod_a}:Alpha",
                                                                         "beta": mod_b}},
                       {mod_a: "raise RuntimeError('imported while listing')",
                        mod_b: "raise RuntimeError('imported while listing')"})
    put_on_path(monkeypatch, tmp_path)
    registry: Registry = Registry("task", Task, entry_point_group=fresh_group)

    assert registry.names() == ["alpha", "beta"]
    assert registry.source("alpha").startswith("distribution 'hetfair-test-listing' 1.0 (entry point alpha")
    assert mod_a not in sys.modules and mod_b not in sys.modules


def test_only_the_chosen_entry_point_is_imported(tmp_path, monkeypatch, fresh_group):
    mod_a, mod_b = f"chosen_{suffix()}", f"unchosen_{suffix()}"
    plain_task = "from hetfair.tasks import Task\n\nclass PlainTask(Task):\n    pass\n"
    write_distribution(tmp_path, "hetfair-test-lazy",
                       {fresh_group: {"chosen": f"{mod_a}:PlainTask", "unchosen": f"{mod_b}:PlainTask"}},
                       {mod_a: plain_task, mod_b: plain_task})
    put_on_path(monkeypatch, tmp_path)
    registry: Registry = Registry("task", Task, entry_point_group=fresh_group)

    chosen = registry.get("chosen")
    assert chosen is sys.modules[mod_a].PlainTask, "a class entry point without decorator is registered"
    assert registry.get("chosen") is chosen
    assert mod_b not in sys.modules


def test_failing_plugin_is_reported_with_distribution_entry_point_and_cause(tmp_path, monkeypatch, fresh_group):
    broken, fine = f"broken_{suffix()}", f"fine_{suffix()}"
    write_distribution(tmp_path, "hetfair-test-broken", {fresh_group: {"broken": f"{broken}:Task"}},
                       {broken: "raise ImportError('libfoo.so: cannot open shared object file')"})
    write_distribution(tmp_path, "hetfair-test-fine", {fresh_group: {"fine": f"{fine}:FineTask"}},
                       {fine: "from hetfair.tasks import Task\n\nclass FineTask(Task):\n    pass\n"})
    put_on_path(monkeypatch, tmp_path)
    registry: Registry = Registry("task", Task, entry_point_group=fresh_group)

    with pytest.raises(errors.PluginLoadError) as caught:
        registry.get("broken")
    message = str(caught.value)
    assert "'hetfair-test-broken'" in message
    assert f"broken = {broken}:Task" in message
    assert "ImportError: libfoo.so: cannot open shared object file" in message
    assert "\n" not in message
    assert registry.names() == ["broken", "fine"], "listing still works"
    assert registry.get("fine").__name__ == "FineTask", "unrelated plugins still load"


def test_same_name_from_two_distributions_names_both(tmp_path, monkeypatch, fresh_group):
    for dist in ("hetfair-test-one", "hetfair-test-two"):
        module = f"{dist.replace('-', '_')}_{suffix()}"
        write_distribution(tmp_path, dist, {fresh_group: {"shared": f"{module}:Task"}}, {module: "\n"})
    put_on_path(monkeypatch, tmp_path)
    registry: Registry = Registry("task", Task, entry_point_group=fresh_group)

    assert registry.names() == ["shared"]
    with pytest.raises(errors.DuplicateComponentError) as caught:
        registry.get("shared")
    assert "'hetfair-test-one'" in str(caught.value)
    assert "'hetfair-test-two'" in str(caught.value)


def test_entry_point_clashing_with_local_registration_names_both(tmp_path, monkeypatch, fresh_group):
    module = f"clash_{suffix()}"
    write_distribution(tmp_path, "hetfair-test-clash", {fresh_group: {"taken": f"{module}:Task"}},
                       {module: "\n"})
    put_on_path(monkeypatch, tmp_path)
    registry: Registry = Registry("task", Task, entry_point_group=fresh_group)

    class LocalTask(Task):
        pass

    registry.add("taken", LocalTask)
    with pytest.raises(errors.DuplicateComponentError) as caught:
        registry.get("taken")
    assert f"{__name__}.{LocalTask.__qualname__}" in str(caught.value)
    assert "'hetfair-test-clash'" in str(caught.value)


def test_module_entry_point_that_registers_nothing_is_an_error(tmp_path, monkeypatch, fresh_group):
    module = f"empty_{suffix()}"
    write_distribution(tmp_path, "hetfair-test-empty", {fresh_group: {"ghost": module}}, {module: "\n"})
    put_on_path(monkeypatch, tmp_path)
    registry: Registry = Registry("task", Task, entry_point_group=fresh_group)
    with pytest.raises(errors.PluginLoadError, match="did not register a task named 'ghost'"):
        registry.get("ghost")


def test_class_entry_point_of_wrong_type_is_refused(tmp_path, monkeypatch, fresh_group):
    module = f"wrong_{suffix()}"
    write_distribution(tmp_path, "hetfair-test-wrong", {fresh_group: {"wrong": f"{module}:NotATask"}},
                       {module: "class NotATask:\n    pass\n"})
    put_on_path(monkeypatch, tmp_path)
    registry: Registry = Registry("task", Task, entry_point_group=fresh_group)
    with pytest.raises(errors.ComponentTypeError, match=f"{module}.NotATask must be a subclass"):
        registry.get("wrong")


def test_module_entry_point_registering_through_public_decorator(tmp_path, monkeypatch):
    module, task = f"decorated_{suffix()}", f"ep_task_{suffix()}"
    code = f"""
        import hetfair
        from hetfair.tasks import Task

        @hetfair.register_task("{task}")
        class DecoratedTask(Task):
            pass
    """
    write_distribution(tmp_path, "hetfair-test-decorated", {"hetfair.tasks": {task: module}}, {module: code})
    put_on_path(monkeypatch, tmp_path)

    assert task in TASK_REGISTRY.names()
    assert module not in sys.modules
    assert TASK_REGISTRY.get(task) is sys.modules[module].DecoratedTask
    assert "distribution 'hetfair-test-decorated'" in TASK_REGISTRY.source(task)


# -- entry points through the hetfair-train command --------------------------------

GOOD_PLUGIN = """
    import os, pathlib
    pathlib.Path(os.environ["PLUGIN_MARKERS"], __name__).touch()

    import hetfair
    from hetfair.models import HetfairModel
    from hetfair.tasks import Task

    @hetfair.register_task("cli_ep_task")
    class CliTask(Task):
        option_defaults = {"arch": "cli_ep_arch", "max_sentences": 4}

        @staticmethod
        def add_args(parser):
            parser.add_argument("--cli-ep-task-flag", help="from the module entry point")

    @hetfair.register_model("cli_ep_model")
    class CliModel(HetfairModel):
        @staticmethod
        def add_args(parser):
            parser.add_argument("--cli-ep-model-flag", help="from the model")

    @hetfair.register_model_architecture("cli_ep_model", "cli_ep_arch")
    def cli_ep_arch():
        return {}
"""
PLAIN_CRITERION = """
    import os, pathlib
    pathlib.Path(os.environ["PLUGIN_MARKERS"], __name__).touch()

    from hetfair.criteria import HetfairCriterion

    class PlainCriterion(HetfairCriterion):  # no decorator: the entry point names the class
        @staticmethod
        def add_args(parser):
            parser.add_argument("--cli-ep-crit-flag", help="from the class entry point")
"""
BROKEN_PLUGIN = """
    import os, pathlib
    pathlib.Path(os.environ["PLUGIN_MARKERS"], __name__).touch()
    raise RuntimeError("missing native library libbroken.so")
"""


@pytest.fixture
def installed_plugins(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """Two fake installed distributions (one broken) and the environment marking imports."""
    site, markers = tmp_path / "site", tmp_path / "markers"
    markers.mkdir()
    write_distribution(site, "hetfair-test-good",
                       {"hetfair.tasks": {"cli_ep_task": "cli_ep_plugin"},
                        "hetfair.models": {"cli_ep_model": "cli_ep_plugin"},
                        "hetfair.archs": {"cli_ep_arch": "cli_ep_plugin:cli_ep_arch"},
                        "hetfair.criteria": {"cli_ep_crit": "cli_ep_criterion:PlainCriterion"}},
                       {"cli_ep_plugin": GOOD_PLUGIN, "cli_ep_criterion": PLAIN_CRITERION})
    write_distribution(site, "hetfair-test-broken",
                       {"hetfair.tasks": {"cli_broken_task": "cli_broken_plugin:BrokenTask"}},
                       {"cli_broken_plugin": BROKEN_PLUGIN})
    return site, {"PLUGIN_MARKERS": str(markers)}


def imported_modules(env: dict[str, str]) -> set[str]:
    return {p.name for p in Path(env["PLUGIN_MARKERS"]).iterdir()}


def test_list_plugins_shows_distributions_without_importing_them(installed_plugins, tmp_path):
    site, env = installed_plugins
    result = run_train("--list-plugins", pythonpath=site, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    expected = {"cli_ep_task": "hetfair-test-good", "cli_ep_model": "hetfair-test-good",
                "cli_ep_arch": "hetfair-test-good", "cli_ep_crit": "hetfair-test-good",
                "cli_broken_task": "hetfair-test-broken"}
    for name, dist in expected.items():
        assert any(line.split()[:2] == [name, "distribution"] and f"'{dist}'" in line for line in lines), name
    assert imported_modules(env) == set()


def test_broken_plugin_fails_only_when_chosen_with_one_line(installed_plugins, tmp_path):
    site, env = installed_plugins
    line = assert_one_error_line(run_train("--task", "cli_broken_task", pythonpath=site, env=env, cwd=tmp_path))
    assert "'hetfair-test-broken'" in line
    assert "cli_broken_task = cli_broken_plugin:BrokenTask" in line
    assert "RuntimeError: missing native library libbroken.so" in line


def test_chosen_plugins_load_and_others_stay_unimported(installed_plugins, tmp_path):
    site, env = installed_plugins
    # the installed script: a fresh interpreter with the plugins on PYTHONPATH from its start imports none early
    result = run_script("--task", "cli_ep_task", "--criterion", "cli_ep_crit", "--help",
                        pythonpath=site, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for flag in ("--cli-ep-task-flag", "--cli-ep-model-flag", "--cli-ep-crit-flag"):
        assert flag in result.stdout
    assert imported_modules(env) == {"cli_ep_plugin", "cli_ep_criterion"}


def test_list_plugins_names_the_model_of_imported_architectures(user_dir, capsys):
    package, task = user_dir
    arch_code = f"""
        import hetfair

        @hetfair.register_model_architecture("{task}_model", "{task}_small")
        def small():
            return {{}}
    """
    (package / "archs.py").write_text(textwrap.dedent(arch_code))
    (package / "__init__.py").write_text((package / "__init__.py").read_text() + "\nfrom . import archs\n")
    assert main(["--user-dir", str(package), "--list-plugins"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.split()[:1] == [f"{task}_small"])
    assert line.endswith(f"user code ({package.name}.archs.small), model {task}_model")


def test_list_plugins_shows_a_clash_between_distributions_and_fails(tmp_path):
    site = tmp_path / "site"
    for dist in ("hetfair-test-first", "hetfair-test-second"):
        module = dist.replace("-", "_")
        write_distribution(site, dist, {"hetfair.criteria": {"cli_shared_crit": f"{module}:Criterion"}},
                           {module: "raise RuntimeError('imported while listing')"})
    result = run_train("--list-plugins", pythonpath=site, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.split()[:1] == ["cli_shared_crit"]]
    assert len(rows) == 2 and all(row.endswith("<- clash") for row in rows)
    assert "'hetfair-test-first'" in rows[0] and "'hetfair-test-second'" in rows[1]
    line = assert_one_error_line(result)
    assert "1 name is defined more than once (criterion 'cli_shared_crit': distribution 'hetfair-test-first'" in line
    assert "and distribution 'hetfair-test-second'" in line
    assert "Traceback" not in result.stderr


def test_list_plugins_shows_a_clash_between_a_distribution_and_a_user_dir(tmp_path):
    site = tmp_path / "site"
    write_distribution(site, "hetfair-test-taken", {"hetfair.tasks": {"cli_taken_task": "cli_taken:Task"}},
                       {"cli_taken": "raise RuntimeError('imported while listing')"})
    package = write_package(tmp_path, f"user_plugins_{suffix()}", USER_TASK.format(task="cli_taken_task"))
    result = run_train("--user-dir", str(package), "--list-plugins", pythonpath=site, cwd=tmp_path)
    assert result.returncode == 2
    rows = [line for line in result.stdout.splitlines() if line.split()[:1] == ["cli_taken_task"]]
    assert [row.split()[1] for row in rows] == ["distribution", "user"]
    assert "task 'cli_taken_task': distribution 'hetfair-test-taken'" in assert_one_error_line(result)


def test_piping_the_listing_into_a_closed_pipe_ends_quietly(tmp_path):
    script = Path(sys.executable).with_name("hetfair-train")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "hetfair_cli.train"]
    reader, writer = os.pipe()
    os.close(reader)  # like `| true`: nobody will read what it prints
    try:
        result = subprocess.run(command + ["--list-plugins"], stdout=writer, stderr=subprocess.PIPE, text=True,
                                cwd=tmp_path, timeout=120, check=False)
    finally:
        os.close(writer)
    assert result.stderr == ""
    assert result.returncode == 141  # as if killed by SIGPIPE

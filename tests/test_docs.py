"""The documentation: the site builds with ``mkdocs build --strict``, the README names only flags that exist
(the multi-node recipes of the README and the docs run in test_readme_recipes.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO_ROOT
from hetfair.options import build_parser
from hetfair_cli.plan import main as plan_main
from hetfair_cli.train import main as train_main
from hetfair_cli.validate import main as validate_main

README = REPO_ROOT / "README.md"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as `mkdocs build --strict` writes it: a broken link, anchor or nav entry fails it."""
    site_dir = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about MkDocs 2.0, not ours to act on
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
                           cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    return site_dir


def test_the_site_builds_strictly(site: Path) -> None:
    assert (site / "index.html").is_file()


def test_the_option_reference_lists_every_core_option(site: Path) -> None:
    page = (site / "options" / "index.html").read_text()
    flags = [action.option_strings[0] for action in build_parser()._actions if action.dest != "help"]
    missing = [flag for flag in flags if f"<code>{flag}" not in page]
    assert not missing, f"docs/options.md lacks {missing}"


def test_the_api_page_renders_the_docstrings(site: Path) -> None:
    page = (site / "api" / "index.html").read_text()
    for name in ("pretrained.load_model", "models.register_model_architecture", "registry.Registry.register",
                 "tasks.Task", "models.HetfairModel", "criteria.HetfairCriterion", "optim.HetfairOptimizer",
                 "optim.LRScheduler", "errors.ConfigError"):
        assert f'id="hetfair.{name}"' in page, name
    assert "Decorator registering a class" in page  # Registry.register's docstring, rendered


def test_the_readme_stays_short() -> None:
    assert len(README.read_text().splitlines()) < 400


OTHER_TOOLS_FLAGS = {"--logdir", "--strict"}  # tensorboard's and mkdocs build's, as the README uses them


def command_help(main, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def option_paragraph(help_text: str, flag: str) -> str:
    """The lines of ``--help`` that describe ``flag``: its own line and the indented ones after it."""
    lines = help_text.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"  (-\w+ [A-Z_]+, |-\w, )?{flag}\b", line))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith(" " * 6)), len(lines))
    return "\n".join(lines[start:end])


def test_the_readme_names_only_flags_and_values_that_exist(capsys: pytest.CaptureFixture[str]) -> None:
    """Every --flag of the README is one of hetfair-train's (with the MNIST plugin), hetfair-validate's or
    hetfair-plan's, and a
    flag that takes a name from a list (``one of:``, ``{a,b}``) is given one from it."""
    helps = (command_help(train_main, ["--user-dir", str(REPO_ROOT / "plugins"), "--task", "mnist"], capsys)
             + command_help(validate_main, [], capsys) + command_help(plan_main, [], capsys))
    readme = README.read_text()
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", readme)) - OTHER_TOOLS_FLAGS
    assert sorted(flag for flag in flags if not re.search(rf"(?<![\w-]){flag}\b", helps)) == []
    for flag, value in set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)[ =]([a-z][a-z0-9_-]*)", readme)):
        paragraph = "" if flag in OTHER_TOOLS_FLAGS else option_paragraph(helps, flag)
        if "one of:" in paragraph or "{" in paragraph.split("\n")[0]:
            assert value in re.findall(r"[a-z][a-z0-9_-]*", paragraph), (flag, value, paragraph)

"""The documentation: the site builds with ``mkdocs build --strict`` (the README's two-node recipe runs in
test_readme_recipes.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO_ROOT
from hetfair.options import build_parser

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

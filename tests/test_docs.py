"""The documentation: the site builds with ``mkdocs build --strict``, and the README's two-node example runs."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO_ROOT, free_port, run_nodes
from hetfair.options import build_parser

README = REPO_ROOT / "README.md"
FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")


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


def readme_two_node_commands() -> list[list[str]]:
    """The hetfair-train commands of the README's two-node example, one per host, as argument lists."""
    section = README.read_text().split("## Two nodes", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1).replace("\\\n", " ")
    return [shlex.split(line)[1:] for line in block.splitlines() if line.startswith("hetfair-train ")]


@pytest.mark.skipif(not FASHION_MNIST.is_dir(), reason=f"Fashion-MNIST is not installed in {FASHION_MNIST} "
                                                       "(Debian package dataset-fashion-mnist)")
def test_the_readme_two_node_example_trains_with_its_batch_split(tmp_path: Path, monkeypatch) -> None:
    commands = readme_two_node_commands()
    assert len(commands) == 2
    address = f"tcp://127.0.0.1:{free_port()}"  # both "hosts" on this machine
    short = ["--max-update", "2", "--disable-validation", "--log-format", "simple", "--log-interval", "1"]
    commands = [[address if arg == "tcp://hostA:12345" else arg for arg in command] + short for command in commands]
    monkeypatch.setenv("HETFAIR_SECRET", "readme-example")
    (tmp_path / "plugins").symlink_to(REPO_ROOT / "plugins")  # "the same checkout" on both hosts
    results = run_nodes(commands, cwd=tmp_path)
    for result in results:
        assert result.returncode == 0, result.stderr[-2000:]
    assert "share0 75.0" in results[0].stderr and "share1 25.0" in results[0].stderr, results[0].stderr[-2000:]

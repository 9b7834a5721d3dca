"""The first commands a user runs, run as the user runs them.

``make demo`` (its own recipe, through make) and the README's quickstart commands run as
subprocesses of the virtual environment's console scripts, in a fresh copy of the checkout
(the files git tracks or would add: no checkpoints, no caches). An in-process call of a main
can pass where the typed command fails (its plugin registered by an earlier test); these
cannot. The README's commands are parsed and must be the Makefile's, so an edit of one alone
fails here. Training is cut to 3,000 images (``DEMO_FLAGS``: one epoch of 47 updates), and the
test accuracy it reaches is held to a real bound.
"""

from __future__ import annotations

import configparser
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO_ROOT, fashion_mnist_installed, subprocess_env

VENV = Path(sys.executable).parent.parent
BUDGET = "--max-images 3000"

needs_make_and_data = pytest.mark.skipif(
    shutil.which("make") is None or not fashion_mnist_installed()
    or not (VENV / "bin" / "hetfair-train").is_file(),
    reason="make demo needs make, Debian's dataset-fashion-mnist and hetfair's console scripts beside this Python",
)


def readme_section(heading: str) -> str:
    text = (REPO_ROOT / "README.md").read_text()
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end]


def code_blocks(section: str) -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", section, flags=re.DOTALL)


def shell_commands(script: str) -> list[str]:
    """The commands of a shell snippet: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", "", script)
    commands = (line.split("  #")[0].strip() for line in joined.splitlines())
    return [" ".join(command.split()) for command in commands if command and not command.startswith("#")]


def quickstart_commands() -> list[str]:
    """The hetfair commands of the README's quickstart block, in order."""
    block = code_blocks(readme_section("## Quickstart: MNIST"))[0]
    return [command for command in shell_commands(block) if command.startswith("hetfair-")]


def make_demo_commands() -> list[str]:
    """The hetfair commands of make demo's own recipe, as make expands them (without the venv's bin/)."""
    dry_run = subprocess.run(["make", "-n", "-o", "setup", "-o", "demo-data", "demo", f"VENV={VENV}"],
                             cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    bin_dir = f"{VENV}/bin/"
    return [command[len(bin_dir):] for command in shell_commands(dry_run.stdout)
            if command.startswith(bin_dir + "hetfair-")]


def phases(lines: list[str]) -> list[str]:
    """What each line of training output is (``data``, ``setup``, ``train_inner`` ...), repeats merged."""
    kinds = [line.split(" | ")[0].split()[0] for line in lines if line.strip() and line.strip() != "..."]
    return [kind for i, kind in enumerate(kinds) if i == 0 or kinds[i - 1] != kind]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh copy of the checkout: the files git tracks or would add, nothing it ignores."""
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("a fresh copy of the checkout needs git and a git checkout")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    copy = tmp_path_factory.mktemp("checkout")
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_file():  # a file deleted but not yet committed is still listed
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    return copy


def make_demo(checkout: Path) -> subprocess.CompletedProcess:
    """``make demo`` in ``checkout``, set-up steps taken as done (this venv is set up), training cut short."""
    return subprocess.run(["make", "-o", "setup", "-o", "demo-data", "demo", f"VENV={VENV}", f"DEMO_FLAGS={BUDGET}"],
                          cwd=checkout, env=subprocess_env(), capture_output=True, text=True, timeout=1200)


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_the_readme_quickstart_types_what_make_demo_runs():
    assert quickstart_commands()[:2] == make_demo_commands()


def test_the_install_page_names_every_console_script():
    setup = configparser.ConfigParser()
    setup.read(REPO_ROOT / "setup.cfg")
    scripts = [line.split("=")[0].strip() for line in setup["options.entry_points"]["console_scripts"].splitlines()
               if line.strip()]
    listed = re.search(r"^Console scripts: (.*?)[;.]", (REPO_ROOT / "docs" / "install.md").read_text(), flags=re.MULTILINE)
    assert re.findall(r"`([^`]+)`", listed.group(1)) == scripts


@needs_make_and_data
def test_make_demo_works_on_a_fresh_checkout_and_again(checkout):
    first = make_demo(checkout)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    [test_line] = [line for line in first.stdout.splitlines() if line.startswith("test | ")]
    accuracy = float(re.search(r"\| accuracy (\S+)", test_line).group(1))
    assert accuracy >= 70.0, test_line  # 47 updates on 3,000 images; 10% is chance
    assert "Checkpoints:     checkpoints/demo/checkpoint_best.pt and checkpoint_last.pt" in first.stdout
    sample = code_blocks(readme_section("## Quickstart: MNIST").split("**What it prints**")[1])[0]
    training = first.stderr.split("\nTensorBoard logs are in")[0].splitlines() + ["TensorBoard logs are in"]
    assert phases(training) == phases(sample.splitlines())  # the README shows the real order

    again = make_demo(checkout)  # the job is done: nothing to train, the same evaluation
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "nothing to do: --max-epoch 1 reached" in again.stderr
    assert test_line in again.stdout.splitlines()


@needs_make_and_data
def test_the_readme_quickstart_tools_run(checkout):
    for command in quickstart_commands()[2:]:
        program, *arguments = shlex.split(command)
        result = subprocess.run([str(VENV / "bin" / program), *arguments], cwd=checkout, env=subprocess_env(),
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{command}: {result.stderr}"
        assert "mnist" in result.stdout, command

"""The set-up behind ``make demo`` / ``make test``: which torch build gets installed where."""

from __future__ import annotations

import importlib.util
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO_ROOT

SPEC = importlib.util.spec_from_file_location("install_torch", REPO_ROOT / "tools" / "install_torch.py")
install_torch = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(install_torch)


def test_a_machine_without_gpu_gets_the_cpu_build_local_mirror_first():
    assert install_torch.install_attempts("2.13.0", gpu=False, system="Linux", machine="x86_64") == [
        ["torch==2.13.0+cpu"],
        ["torch==2.13.0+cpu", "--extra-index-url", "https://download.pytorch.org/whl/cpu"],
    ]


def test_a_gpu_machine_gets_pypis_default_cuda_build():
    assert install_torch.install_attempts("2.13.0", gpu=True, system="Linux", machine="x86_64") == [
        ["torch==2.13.0"]]


@pytest.mark.parametrize("system, machine", [("Darwin", "arm64"), ("Linux", "aarch64"), ("Windows", "AMD64")])
def test_where_pypis_wheel_is_a_cpu_build_it_is_taken(system, machine):
    assert install_torch.install_attempts("2.13.0", gpu=False, system=system, machine=machine) == [
        ["torch==2.13.0"]]


def fake_nvidia_smi(directory: Path, output: str, code: int = 0) -> Path:
    script = directory / "nvidia-smi"
    script.write_text(f"#!/bin/sh\necho '{output}'\nexit {code}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return directory


@pytest.mark.parametrize(
    "output, code, expected",
    [
        ("GPU 0: NVIDIA H200 (UUID: GPU-1234)", 0, True),
        ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", 9, False),
        ("No devices were found", 6, False),
    ],
    ids=["gpu", "no-driver", "no-device"],
)
def test_a_gpu_is_what_nvidia_smi_lists(tmp_path, monkeypatch, output, code, expected):
    monkeypatch.setenv("PATH", str(fake_nvidia_smi(tmp_path, output, code)))
    assert install_torch.has_nvidia_gpu() is expected


def test_no_nvidia_smi_means_no_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert install_torch.has_nvidia_gpu() is False


def test_an_installed_torch_is_kept(capsys):
    assert install_torch.main([sys.executable, "0.0.0"]) == 0  # this interpreter has torch: nothing to install
    import torch

    assert capsys.readouterr().out == f"torch {torch.__version__} is already installed; keeping it\n"


def make_dry_run(*targets: str) -> str:
    """The commands ``make`` would run for ``targets`` on a machine where nothing is set up yet."""
    dry_run = subprocess.run(["make", "-n", "-B", *targets, "VENV=/nonexistent-venv"], cwd=REPO_ROOT,
                             capture_output=True, text=True, check=False)
    assert dry_run.returncode == 0, dry_run.stderr
    return dry_run.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_the_makefile_wires_both_commands_to_the_set_up():
    commands = make_dry_run("demo", "test")
    assert "tools/install_torch.py /nonexistent-venv/bin/python 2.13.0" in commands
    assert "pip install --quiet -e . -e plugins/hetfair_plugin_example" in commands
    assert "pip install --quiet --no-compile -e \".[test]\" -e plugins/hetfair_plugin_example" in commands
    assert "tools/install_debian_packages.sh dataset-fashion-mnist jargon-text" in commands


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_demo_installs_what_the_demo_needs_and_no_test_tools():
    commands = make_dry_run("demo")
    assert "pip install --quiet -e . -e plugins/hetfair_plugin_example" in commands
    assert ".[test]" not in commands and "jargon-text" not in commands
    assert "tools/install_debian_packages.sh dataset-fashion-mnist" in commands


def test_running_a_part_of_the_suite_runs_as_typed_in_docs_testing():
    """docs/testing.md's ``make test PYTEST_ARGS=...`` runs that part of the suite (its serial pass finds none)."""
    typed = next(line.split("#")[0].strip() for line in (REPO_ROOT / "docs" / "testing.md").read_text().splitlines()
                 if line.startswith("make test PYTEST_ARGS="))
    assert typed == 'make test PYTEST_ARGS="-q tests/test_layering.py"'
    done = subprocess.run(["bash", "-c", typed], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    passes = [line for line in done.stdout.splitlines() if " passed" in line]
    assert len(passes) == 1 and "failed" not in passes[0], done.stdout[-3000:]


def test_make_test_runs_the_serial_groups_side_by_side_after_the_rest():
    """``make test``: the xdist pass skips the serial tests, the second pass runs only those, a group per worker,
    and a selection without any (exit status 5 there) does not fail the command; ``TEST_WORKERS=1`` is one pass."""
    done = subprocess.run(["make", "-n", "test", "TEST_WORKERS=3"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    commands = [line for line in done.stdout.splitlines() if "-m pytest" in line]
    assert len(commands) == 2, done.stdout
    assert '-m "not serial" -n 3 --dist loadfile' in commands[0]
    assert commands[1].endswith("-m serial -n 2 --dist loadgroup || [ $? -eq 5 ]")
    one = subprocess.run(["make", "-n", "test", "TEST_WORKERS=1"], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=60)
    assert [line.split("python ", 1)[1] for line in one.stdout.splitlines() if "-m pytest" in line] == [
        "-m pytest -q"]

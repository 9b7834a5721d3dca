"""Start-up cost: the command line imports optional heavy libraries only when they are used.

``sentencepiece`` and ``tokenizers`` belong to the BERT task, ``transformers`` to
``--arch hf_encoder``, ``datasets`` to the sentence_classification task, ``tensorboard`` to
``--tensorboard-logdir``; ``--help``, ``--list-plugins`` and a run of another task must not
import them. Each case runs in a fresh interpreter (the test session itself has imported
whatever other tests needed).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FASHION_MNIST, REPO_ROOT, needs_fashion_mnist, subprocess_env

OPTIONAL = ("sentencepiece", "tokenizers", "tensorboard", "torch.utils.tensorboard", "transformers",
            "datasets")

PROBE = """
import json, sys
from hetfair_cli.train import main
try:
    code = main(json.loads(sys.argv[1]))
except SystemExit as exc:  # argparse's --help
    code = exc.code
print(json.dumps({"code": code, "imported": [name for name in json.loads(sys.argv[2]) if name in sys.modules]}))
"""


def imported_after(argv: list[str], cwd: Path) -> list[str]:
    """Run ``hetfair_cli.train.main(argv)`` in a fresh interpreter; the optional modules it imported."""
    result = subprocess.run([sys.executable, "-c", PROBE, json.dumps(argv), json.dumps(OPTIONAL)], cwd=cwd,
                            env=subprocess_env(), capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["code"] == 0, result.stderr
    return report["imported"]


@pytest.mark.parametrize("argv", [["--help"], ["--list-plugins"]], ids=["help", "list-plugins"])
def test_help_and_listing_import_no_optional_library(argv, tmp_path):
    assert imported_after(argv, tmp_path) == []


@needs_fashion_mnist
def test_mnist_plugin_run_imports_no_optional_library(tmp_path):
    argv = ["--user-dir", str(REPO_ROOT / "plugins"), "--task", "mnist", "--data", str(FASHION_MNIST),
            "--arch", "mnist_mlp", "--max-sentences", "8", "--max-update", "1", "--cpu", "--no-save",
            "--disable-validation", "--log-format", "none", "--save-dir", str(tmp_path / "checkpoints")]
    assert imported_after(argv, tmp_path) == []


def test_installed_entry_points_are_scanned_once_until_sys_path_changes(monkeypatch, tmp_path):
    from importlib import metadata

    from hetfair.inventory import describe_plugins
    from hetfair.options import parse_train_args
    from hetfair.plugins import clear_entry_point_cache

    scans = []
    scan = metadata.entry_points
    monkeypatch.setattr(metadata, "entry_points", lambda **params: scans.append(params) or scan(**params))
    clear_entry_point_cache()
    parse_train_args(["--list-plugins"])
    describe_plugins()
    parse_train_args(["--user-dir", str(REPO_ROOT / "plugins"), "--task", "mnist"])
    assert len(scans) == 1, "one scan of all groups serves every registry"

    monkeypatch.syspath_prepend(str(tmp_path))  # where new distributions may be found
    describe_plugins()
    assert len(scans) == 2
    clear_entry_point_cache()  # e.g. after installing into a directory already on sys.path
    describe_plugins()
    assert len(scans) == 3

"""``benchmarks/gpu_check.py``, the script for a lent GPU: its CPU dry run, and its refusal without CUDA."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from helpers import REPO_ROOT, subprocess_env
from hetfair.memory.sizes import parse_size

SCRIPT = REPO_ROOT / "benchmarks" / "gpu_check.py"


def run_script(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True,
                          env=subprocess_env(), timeout=300, check=False)


def test_dry_run_checks_collectives_trains_in_every_precision_and_probes() -> None:
    result = run_script("--dry-run")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "collectives | gloo initialised for 1 process; all_reduce ok" in lines
    assert any(line.startswith("uneven | offload 0: 2 AdamW updates equal the whole model's") for line in lines)
    rows = {line.split()[0]: line.split() for line in lines if line.split() and line.split()[0] in
            ("fp32", "bf16", "fp16")}
    assert set(rows) == {"fp32", "bf16", "fp16"}
    for precision, fields in rows.items():
        seq_s, first_loss, last_loss, skipped = float(fields[1]), float(fields[3]), float(fields[5]), int(fields[6])
        assert seq_s > 0 and 0 < first_loss < 10 and 0 < last_loss < 10 and skipped == 0, precision
        assert parse_size(fields[7]) > 0, precision  # the peak memory
    assert rows["fp32"][-2:] == ["seq/s", "(TF32)"] and rows["fp16"][-3] == "580"
    [probe] = [line for line in lines if line.startswith("oom probe | ")]  # the plan's probe met its limit, then trained
    assert " did not, under a budget 16M above the process's memory" in probe and "nothing left allocated" in probe


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible: the script would run for real")
def test_without_cuda_it_stops_with_one_line() -> None:
    result = run_script()
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("gpu_check: error: no CUDA device is visible")

#!/usr/bin/env python3
"""Install torch into a virtual environment: the CUDA build where an NVIDIA GPU is, else a CPU build.

Usage: ``python3 tools/install_torch.py VENV_PYTHON VERSION`` (what ``make`` runs).

* An environment that already has torch is left alone, whatever build it is: to choose
  another build (ROCm, another CUDA), install it into the environment first.
* With an NVIDIA GPU (``nvidia-smi -L`` lists one): PyPI's ``torch==VERSION``, which on
  Linux x86_64 is the CUDA build.
* Without one, on Linux x86_64, where PyPI's wheel is that CUDA build (several GB):
  ``torch==VERSION+cpu``, from the package indexes pip is configured with when one of
  them has it (e.g. a local mirror), else from PyTorch's CPU index.
* Elsewhere (macOS, Windows, Linux on ARM) PyPI's wheel is already a CPU build.

Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
from typing import Sequence

PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def has_nvidia_gpu() -> bool:
    """True when ``nvidia-smi -L`` runs and lists a GPU."""
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is None:
        return False
    try:
        listing = subprocess.run([nvidia_smi, "-L"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return listing.returncode == 0 and "GPU" in listing.stdout


def install_attempts(version: str, gpu: bool, system: str, machine: str) -> list[list[str]]:
    """The ``pip install`` arguments to try, in order, for torch ``version`` on this machine."""
    if gpu or system != "Linux" or machine not in ("x86_64", "AMD64"):
        return [[f"torch=={version}"]]
    cpu_build = f"torch=={version}+cpu"
    return [[cpu_build], [cpu_build, "--extra-index-url", PYTORCH_CPU_INDEX]]


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2:
        print(__doc__.splitlines()[2], file=sys.stderr)
        return 2
    python, version = argv
    present = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                             text=True, check=False)
    if present.returncode == 0:
        print(f"torch {present.stdout.strip()} is already installed; keeping it")
        return 0
    gpu = has_nvidia_gpu()
    build = "CUDA build (an NVIDIA GPU is present)" if gpu else "CPU build (no NVIDIA GPU)"
    print(f"installing torch {version}, {build}", flush=True)
    *earlier, last = install_attempts(version, gpu, platform.system(), platform.machine())
    for arguments in earlier:  # these may fail quietly: the next attempt follows
        if subprocess.run([python, "-m", "pip", "install", "--quiet", *arguments], capture_output=True,
                          check=False).returncode == 0:
            return 0
    return subprocess.run([python, "-m", "pip", "install", "--quiet", *last], check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

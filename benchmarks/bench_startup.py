"""Start-up cost: ``hetfair-train --help`` and process start to the first update, next to ``import torch``.

Each command runs as a fresh process, the variants alternating, and the median of ``--repeat``
runs is reported. "First update" is the moment the first ``train_inner`` line (``--log-interval 1``)
reaches the parent, for a one-update run of the MNIST plugin on Debian's Fashion-MNIST files.
"plain PyTorch" is the same first update as a user writes it (gunzip the IDX files, standardise,
the same CNN, Adam): what hetfair adds is the difference to it (creating a ``torch.optim``
optimizer imports ``torch._dynamo``, about half of ``import torch`` again, in both).

    python benchmarks/bench_startup.py [--repeat 5] [--tree OTHER_CHECKOUT]

``--tree`` also times another checkout of hetfair (put first on ``PYTHONPATH``), e.g. an older
commit made with ``git worktree add /tmp/old COMMIT``, so before/after compare in one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")


WORKDIR = tempfile.mkdtemp()  # commands run here, so that no checkout's own directory shadows PYTHONPATH


def timed_exit(command: list[str], env: dict[str, str]) -> float:
    """Seconds from start to exit of ``command``."""
    start = time.perf_counter()
    subprocess.run(command, env=env, cwd=WORKDIR, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def timed_first_update(command: list[str], env: dict[str, str]) -> float:
    """Seconds from start until ``command`` reports its first update on stderr."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, env=env, cwd=WORKDIR, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stderr is not None
    seen: Optional[float] = None
    for line in proc.stderr:
        if seen is None and '"train_inner"' in line:
            seen = time.perf_counter() - start
    if proc.wait() != 0 or seen is None:
        raise SystemExit(f"{' '.join(command)} failed or logged no update")
    return seen


def environment(tree: Optional[Path]) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
    return env


def mnist_command(tree: Path, save_dir: str) -> list[str]:
    return [sys.executable, "-m", "hetfair_cli.train", "--user-dir", str(tree / "plugins"), "--task", "mnist",
            "--data", str(FASHION_MNIST), "--max-update", "1", "--max-sentences", "32", "--log-format", "json",
            "--log-interval", "1", "--disable-validation", "--no-save", "--save-dir", save_dir]


PLAIN_FIRST_UPDATE = """
import gzip, sys, numpy as np, torch, torch.nn.functional as F
from torch import nn
def idx(name, offset):
    return np.frombuffer(gzip.decompress(open(f"{sys.argv[1]}/{name}", "rb").read()), np.uint8, offset=offset)
images = torch.from_numpy(idx("train-images-idx3-ubyte.gz", 16).copy()).view(-1, 1, 28, 28)
labels = torch.from_numpy(idx("train-labels-idx1-ubyte.gz", 8).astype(np.int64))
counts = images.view(-1).bincount(minlength=256).double()
values = torch.arange(256, dtype=torch.float64)
mean = float((counts * values).sum() / counts.sum())
std = float(((counts * (values - mean) ** 2).sum() / counts.sum()).sqrt())
x = images.float().sub_(mean).div_(std)
model = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1),
                      nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(),
                      nn.Linear(128, 10))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
batch = torch.randperm(len(labels))[:32]
F.cross_entropy(model(x[batch]), labels[batch]).backward()
optimizer.step()
print('"train_inner"', file=sys.stderr, flush=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tree", type=Path, help="another hetfair checkout to time as well")
    options = parser.parse_args()
    trees = {"this tree": REPO, **({"--tree": options.tree.resolve()} if options.tree else {})}
    save_dir = str(Path(WORKDIR) / "checkpoints")
    cases = {"python -c 'import torch'": lambda tree, env: timed_exit([sys.executable, "-c", "import torch"], env)}
    cases["hetfair-train --help"] = lambda tree, env: timed_exit(
        [sys.executable, "-m", "hetfair_cli.train", "--help"], env)
    cases["plain PyTorch: first update"] = lambda tree, env: timed_first_update(
        [sys.executable, "-c", PLAIN_FIRST_UPDATE, str(FASHION_MNIST)], env)
    cases["start to first update (MNIST)"] = lambda tree, env: timed_first_update(mnist_command(tree, save_dir), env)
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(options.repeat):
        for case, measure in cases.items():
            for label, tree in trees.items():
                times.setdefault((case, label), []).append(measure(tree, environment(tree)))
    load = os.getloadavg()[0]
    print(f"median of {options.repeat} alternating runs, load average {load:.1f} on {os.cpu_count()} cores")
    print(f"{'':32s}" + "".join(f"{label:>14s}" for label in trees))
    for case in cases:
        print(f"{case:32s}" + "".join(f"{statistics.median(times[(case, label)]):13.2f}s" for label in trees))


if __name__ == "__main__":
    main()

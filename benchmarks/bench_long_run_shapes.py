"""Long runs on different cluster shapes: the same training statistically, not to the last bit.

One process of 64 samples, two of 32 and three of 8, 24 and 32 train the same model on the same
data with the same seed and global batch, so every update is the same sum of the same samples'
gradients divided by 64. Only the float summation order differs (one batch, an all-reduce of two
or three partial sums), and training amplifies those last-bit differences: the parameters of the
shapes drift apart. This script measures how far (max and mean |parameter difference| at checkpoints)
and whether the loss curves still agree: for each pair of runs, the mean absolute difference of
their loss averaged over windows of ``--window`` updates. The yardstick is the same shape with
another ``--seed`` (other initial weights and data order): a shape change must move the curve
less than a seed change does, and the final validation accuracies of the shapes must lie
within the seeds' spread.

    .venv/bin/python benchmarks/bench_long_run_shapes.py            # 1000 updates per run (minutes)
    .venv/bin/python benchmarks/bench_long_run_shapes.py --quick    # 300 updates on 8192 images
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    DEFAULT_DATA,
    PLUGIN_DIR,
    REPO_ROOT,
    data_subset,
    machine_note,
    print_table,
    subprocess_env,
)

SHAPES = {"1x64": [64], "2x32": [32, 32], "3x8/24/32": [8, 24, 32]}


@dataclass
class Run:
    """One finished run: its per-update training loss, last validation accuracy and checkpoints."""

    shape: str
    seed: int
    losses: list[float]
    accuracy: float
    save_dir: Path

    @property
    def name(self) -> str:
        return f"{self.shape} seed {self.seed}"

    def parameters(self, updates: int) -> dict[str, torch.Tensor]:
        [path] = self.save_dir.glob(f"checkpoint_*_{updates}.pt")
        return torch.load(path, map_location="cpu", weights_only=True)["trainer"]["model"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="directory of the Fashion-MNIST IDX files")
    parser.add_argument("--arch", default="mnist_mlp", help="architecture of the MNIST plugin (no dropout)")
    parser.add_argument("--updates", type=int, default=1000, help="updates per run")
    parser.add_argument("--window", type=int, default=50, help="updates per window of the loss curves")
    parser.add_argument("--save-every", type=int, default=100, help="updates between the checkpoints compared")
    parser.add_argument("--train-size", type=int, default=16384, help="training images (0: all)")
    parser.add_argument("--seeds", default="1,2", help="two seeds: the first for every shape, the second for two")
    parser.add_argument("--quick", action="store_true", help="300 updates on 8192 images")
    args = parser.parse_args(argv)
    if args.quick:
        args.updates, args.train_size = 300, 8192
    return args


def train(args: argparse.Namespace, data: Path, shape: str, seed: int, save_dir: Path) -> Run:
    """One ``hetfair-train`` run of ``shape``: Adam, per-update JSON lines, a checkpoint every ``--save-every``."""
    sizes = SHAPES[shape]
    command = [sys.executable, "-m", "hetfair_cli.train", "--user-dir", str(PLUGIN_DIR), "--task", "mnist",
               "--data", str(data), "--arch", args.arch, "--cpu", "--seed", str(seed), "--max-epoch", "0",
               "--max-update", str(args.updates), "--log-format", "json", "--log-interval", "1",
               "--save-dir", str(save_dir), "--save-interval-updates", str(args.save_every),
               "--no-epoch-checkpoints", "--max-sentences", ",".join(map(str, sizes))]
    if len(sizes) > 1:
        command += ["--distributed-world-size", str(len(sizes))]
    done = subprocess.run(command, env=subprocess_env(1), cwd=REPO_ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{shape} seed {seed} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    losses = [r["loss"] for r in records if r["phase"] == "train_inner"]
    accuracy = [r["accuracy"] for r in records if r["phase"] == "valid"][-1]
    return Run(shape, seed, losses, accuracy, save_dir)


def windows(losses: list[float], size: int) -> list[float]:
    """Mean loss over consecutive windows of ``size`` updates (a last, partial window dropped)."""
    return [sum(losses[i:i + size]) / size for i in range(0, len(losses) - size + 1, size)]


def curve_distance(a: Run, b: Run, size: int) -> float:
    """Mean |difference| of two runs' windowed loss curves."""
    pairs = list(zip(windows(a.losses, size), windows(b.losses, size)))
    return sum(abs(x - y) for x, y in pairs) / len(pairs)


def parameter_difference(a: Run, b: Run, updates: int) -> str:
    """``max / mean`` of |parameter difference| over all of the model's parameters after ``updates``."""
    pa, pb = a.parameters(updates), b.parameters(updates)
    differences = torch.cat([(pa[name] - pb[name]).abs().flatten() for name in pa])
    return f"{float(differences.max()):.1e} / {float(differences.mean()):.0e}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    first, second = (int(s) for s in args.seeds.split(","))
    with tempfile.TemporaryDirectory(prefix="bench_long_run_") as tmp:
        data = data_subset(args.data, args.train_size, Path(tmp) / "data")
        plan = [(shape, first) for shape in SHAPES] + [("1x64", second), ("2x32", second)]
        runs = {}
        for shape, seed in plan:
            print(f"training {shape} seed {seed} ...", flush=True)
            runs[shape, seed] = train(args, data, shape, seed, Path(tmp) / f"{shape.replace('/', '_')}_{seed}")
        report(args, runs, first, second)


def report(args: argparse.Namespace, runs: dict[tuple[str, int], Run], first: int, second: int) -> None:
    shape_pairs = [(runs["1x64", first], runs["2x32", first]), (runs["1x64", first], runs["3x8/24/32", first]),
                   (runs["1x64", second], runs["2x32", second])]
    seed_pairs = [(runs["1x64", first], runs["1x64", second]), (runs["2x32", first], runs["2x32", second])]
    checkpoints = range(args.save_every, args.updates + 1, args.save_every)
    print_table("max / mean |parameter difference| between shapes of the same seed, by update",
                ["pair", *map(str, checkpoints)],
                [[f"{a.name} vs {b.shape}", *(parameter_difference(a, b, u) for u in checkpoints)]
                 for a, b in shape_pairs])
    rows = [[f"shape: {a.name} vs {b.shape}", f"{curve_distance(a, b, args.window):.2e}"] for a, b in shape_pairs]
    rows += [[f"seed: {a.shape} seed {a.seed} vs {b.seed}", f"{curve_distance(a, b, args.window):.2e}"]
             for a, b in seed_pairs]
    shape_gap = max(curve_distance(a, b, args.window) for a, b in shape_pairs)
    seed_gap = min(curve_distance(a, b, args.window) for a, b in seed_pairs)
    print_table(f"mean |difference| of the loss curves in windows of {args.window} updates", ["pair", "distance"],
                rows, [f"largest shape distance / smallest seed distance = {shape_gap / seed_gap:.3f} "
                       f"({'agree' if shape_gap < seed_gap else 'DIFFER'}: must be below 1)"])
    accuracies = {run.name: run.accuracy for run in runs.values()}
    seed_accuracies = [runs["1x64", s].accuracy for s in (first, second)]
    print_table("validation accuracy after the last update", ["run", "accuracy"],
                [[name, f"{accuracy:.2f}"] for name, accuracy in accuracies.items()],
                [f"shapes of seed {first}: spread {spread([runs[s, first].accuracy for s in SHAPES]):.2f}; "
                 f"1x64 seeds {first} and {second}: spread {spread(seed_accuracies):.2f}", machine_note()])


def spread(values: list[float]) -> float:
    return max(values) - min(values)


if __name__ == "__main__":
    main()

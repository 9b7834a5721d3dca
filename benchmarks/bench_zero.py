"""Optimizer-state sharding side by side: per-rank state bytes, peak RSS and time per update.

Runs hetfair-train with Adam on a wide MLP (benchmarks/zero_plugin, ~7.3M
parameters by default) on 2 and 4 CPU processes, one command per rank, with and
without ``--zero-sharding os`` (plus one run with weighted shards), and prints
one table. Peak RSS comes from each rank process's own rusage (``os.wait4``);
optimizer-state bytes from hetfair's ``zero`` log line (unsharded, every rank
holds the full state, i.e. the sharded ranks' sum); time per update from the
median over the second half of the updates (the first half warms up; the median
resists other load on a shared machine).

    python benchmarks/bench_zero.py [--updates 20] [--hidden 768] [--layers 12]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from zero_plugin import WideMLP  # benchmarks/ is on sys.path when this file runs as a script

PLUGIN = Path(__file__).resolve().parent / "zero_plugin"
CONFIGS: list[tuple[int, str, Optional[str]]] = [
    (2, "none", None), (2, "os", None), (2, "os", "1,3"), (4, "none", None), (4, "os", None),
]
MB = 1024 * 1024


@dataclass
class RunResult:
    state_bytes: Optional[list[int]]  # per rank; None when unsharded (no zero log line)
    peak_rss: list[int]  # bytes, per rank
    seconds_per_update: float


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(world: int, sharding: str, weights: Optional[str], options: argparse.Namespace, workdir: Path) -> RunResult:
    """Train ``options.updates`` updates with one hetfair-train process per rank."""
    half = max(1, options.updates // 2)
    common = [
        sys.executable, "-m", "hetfair_cli.train", "--user-dir", str(PLUGIN), "--task", "bench_random",
        "--bench-hidden", str(options.hidden), "--bench-layers", str(options.layers), "--optimizer", "adam",
        "--max-sentences", str(options.batch), "--max-update", str(2 * half), "--log-interval", "1",
        "--log-format", "json", "--no-save", "--disable-validation", "--zero-sharding", sharding,
        "--distributed-world-size", str(world), "--distributed-gpus", "1",
        "--distributed-init-method", f"tcp://127.0.0.1:{_free_port()}",
    ] + (["--zero-shard-weights", weights] if weights else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = [workdir / f"rank{rank}.log" for rank in range(world)]
    procs = [subprocess.Popen(common + ["--distributed-rank", str(rank)], cwd=workdir, env=env,
                              stdout=subprocess.DEVNULL, stderr=log.open("w"))
             for rank, log in enumerate(logs)]
    peak_rss = []
    for proc, log in zip(procs, logs):
        _, status, usage = os.wait4(proc.pid, 0)  # this rank's own peak RSS, in kilobytes on Linux
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{world} procs, --zero-sharding {sharding} failed:\n{log.read_text()}")
        peak_rss.append(usage.ru_maxrss * 1024)
    stderr = logs[0].read_text()
    records = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    zero = [r for r in records if r["phase"] == "zero"]
    timed = [1.0 / r["ups"] for r in records if r["phase"] == "train_inner" and r["num_updates"] > half]
    state_bytes = [int(zero[0][f"state_bytes{rank}"]) for rank in range(world)] if zero else None
    return RunResult(state_bytes, peak_rss, statistics.median(timed))


def table(results: dict[tuple[int, str, Optional[str]], RunResult]) -> str:
    full_state = {world: sum(r.state_bytes) for (world, _, _), r in results.items() if r.state_bytes}
    lines = [f"{'procs':>5}  {'sharding':<12}  {'optimizer state MB per rank':<30}  "
             f"{'peak RSS MB per rank':<28}  {'ms/update':>9}"]
    for (world, sharding, weights), result in results.items():
        state = result.state_bytes or [full_state[world]] * world
        label = sharding + (f" w={weights}" if weights else "")
        lines.append(f"{world:>5}  {label:<12}  {' / '.join(f'{b / MB:.1f}' for b in state):<30}  "
                     f"{' / '.join(f'{b / MB:.0f}' for b in result.peak_rss):<28}  "
                     f"{1000 * result.seconds_per_update:>9.1f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=20, help="updates per run (timed: the second half)")
    parser.add_argument("--hidden", type=int, default=768, help="MLP width")
    parser.add_argument("--layers", type=int, default=12, help="hidden layers")
    parser.add_argument("--batch", type=int, default=16, help="samples per rank and update")
    options = parser.parse_args()
    parameters = sum(p.numel() for p in WideMLP(options.hidden, options.layers).parameters())
    print(f"Adam, MLP of {parameters / 1e6:.1f}M parameters, {options.batch} samples per rank, "
          f"{options.updates} updates, {os.cpu_count()} CPU cores, gloo")
    with tempfile.TemporaryDirectory() as workdir:
        results = {config: run(*config, options, Path(workdir)) for config in CONFIGS}
    print(table(results))


if __name__ == "__main__":
    main()

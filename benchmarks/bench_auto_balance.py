"""Throughput on a simulated 1:1:2:4 cluster: equal split vs hand-tuned split vs --auto-balance.

Four hetfair-train processes on this machine; each one's forward pass sleeps in
proportion to its batch size over its speed (``benchmarks/simcluster``), so the
sleep dominates and 2 CPU cores suffice. All set-ups train on the same
global batch. Throughput is samples per second of wall-clock time between log
lines, and "of ideal" divides it by the sum of the ranks' simulated speeds
(speed_r / sample time). An equal split is bounded by 4 x slowest / sum = 0.5.
"samples/s", "of ideal" and "balance_eff" cover the updates from --steady-from
on; "whole run" covers all updates, auto-balance's measuring phase included.
"probe s" is what auto-balance's start-up probe took on the slowest rank (the
job waits for it), "+ probe" is "whole run" with those seconds added. "wall-clock"
divides all updates' samples by the seconds of the training clock, from before
the probe to the last update (the probe, the trainer's set-up, e.g. 5-13 s on
2 loaded cores, and the first update's costs: the same code in every set-up),
and "process s" are the seconds from starting the four processes to their exit.

    python benchmarks/bench_auto_balance.py [--updates 80] [--sample-ms 40] [--setups equal,static,auto]

The sleep must dwarf the framework's own per-step cost (collectives, Python; about
30 ms per step for 4 processes on 2 busy cores), which no split can remove.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SIMCLUSTER = Path(__file__).resolve().parent / "simcluster"
SPEEDS = [1.0, 1.0, 2.0, 4.0]
GLOBAL_BATCH = 128
LOG_INTERVAL = 10


@dataclass
class Setup:
    name: str
    caps: list[int]
    extra: list[str]


SETUPS = [
    Setup("equal split", [GLOBAL_BATCH // 4] * 4, []),
    Setup("static split by speed", [int(GLOBAL_BATCH * speed / sum(SPEEDS)) for speed in SPEEDS], []),
    # each rank could take half the global batch; the balancer finds the split (default tuning)
    Setup("--auto-balance", [GLOBAL_BATCH // 2] * 4, ["--global-batch-size", str(GLOBAL_BATCH), "--auto-balance"]),
    # as before the start-up probe: the split starts in proportion to the batch sizes (equal)
    Setup("auto, batch-sizes start", [GLOBAL_BATCH // 2] * 4,
          ["--global-batch-size", str(GLOBAL_BATCH), "--auto-balance", "--balance-start", "batch-sizes"]),
]
KEYS = {"equal": SETUPS[0], "static": SETUPS[1], "auto": SETUPS[2], "auto-sizes": SETUPS[3]}


@dataclass
class Outcome:
    """One set-up's run: rank 0's JSON records and its other lines, and the seconds from start to exit."""

    records: list[dict[str, Any]]
    lines: list[str]
    seconds: float


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(setup: Setup, updates: int, sample_ms: float, workdir: Path) -> Outcome:
    """Start one process per rank and wait for them."""
    init = f"tcp://127.0.0.1:{free_port()}"
    started = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = []
    for rank, cap in enumerate(setup.caps):
        argv = [
            sys.executable, "-m", "hetfair_cli.train", "--user-dir", str(SIMCLUSTER), "--task", "sim",
            "--sim-train-size", str(GLOBAL_BATCH * (updates + 1)), "--sim-speeds", ",".join(map(str, SPEEDS)),
            "--sim-sample-ms", str(sample_ms), "--optimizer", "sgd", "--lr", "0.1",
            "--max-sentences", str(cap), "--max-update", str(updates), "--no-save", "--disable-validation",
            "--log-format", "json", "--log-interval", str(LOG_INTERVAL),
            "--distributed-world-size", str(len(SPEEDS)), "--distributed-rank", str(rank),
            "--distributed-gpus", "1", "--distributed-init-method", init, *setup.extra,
        ]
        procs.append(subprocess.Popen(argv, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outputs = [proc.communicate() for proc in procs]
    seconds = time.perf_counter() - started
    for proc, (_, err) in zip(procs, outputs):
        if proc.returncode != 0:
            raise SystemExit(f"{setup.name}: a rank failed:\n{err}")
    lines = outputs[0][1].splitlines()
    return Outcome([json.loads(line) for line in lines if line.startswith("{")],
                   [line for line in lines if not line.startswith("{")], seconds)


def throughput(records: list[dict[str, Any]], first_update: int) -> tuple[float, float]:
    """Samples/s and mean balance_eff over the log intervals that start at or after ``first_update``."""
    window = [r for r in records if r["phase"] == "train_inner" and r["num_updates"] - LOG_INTERVAL >= first_update]
    seconds = sum(LOG_INTERVAL / r["ups"] for r in window)
    samples = sum(LOG_INTERVAL * r["bsz"] for r in window)
    return samples / seconds, sum(r["balance_eff"] for r in window) / len(window)


def wall_clock(records: list[dict[str, Any]]) -> float:
    """Samples/s of all updates (each a full global batch) over the training clock's seconds at the last one."""
    last = [r for r in records if r["phase"] == "train_inner"][-1]
    return last["num_updates"] * GLOBAL_BATCH / last["wall"]


def probe_seconds(lines: list[str]) -> float:
    """The start-up probe's seconds on the slowest rank, from the ``balance | starting split`` line (0: no probe)."""
    found = [re.search(r": ([\d.]+) s on the slowest rank", line) for line in lines if line.startswith("balance |")]
    return next((float(match.group(1)) for match in found if match), 0.0)


def resplits(records: list[dict[str, Any]]) -> str:
    """How often the balancer moved the split, and at which updates."""
    updates = [str(r["num_updates"]) for r in records if r["phase"] == "balance"]
    return f"{len(updates)} ({', '.join(updates)})" if updates else "-"


def final_split(records: list[dict[str, Any]]) -> list[int]:
    last = [r for r in records if r["phase"] == "train_inner"][-1]
    return [round(last[f"share{r}"] * GLOBAL_BATCH / 100) for r in range(len(SPEEDS))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=80, help="updates per set-up")
    parser.add_argument("--sample-ms", type=float, default=40.0, help="milliseconds per sample at speed 1")
    parser.add_argument("--steady-from", type=int, default=40,
                        help="first update of the steady-state window (with the default tuning auto-balance decides "
                             "first after update 3 from a probed start, after update 4 from the batch sizes)")
    parser.add_argument("--setups", default="all",
                        help=f"comma-separated set-ups to run: {', '.join(KEYS)} (default: all)")
    args = parser.parse_args()
    setups = SETUPS if args.setups == "all" else [KEYS[key] for key in args.setups.split(",")]
    ideal = sum(SPEEDS) / (args.sample_ms / 1000.0)
    print(f"simulated speeds {SPEEDS}, {args.sample_ms:g} ms/sample at speed 1, global batch {GLOBAL_BATCH}, "
          f"{args.updates} updates; ideal {ideal:.0f} samples/s")
    header = f"{'set-up':<24} {'final split':<14} {'balance_eff':>11} {'samples/s':>10} {'of ideal':>9} " \
             f"{'whole run':>10} {'probe s':>8} {'+ probe':>8} {'wall-clock':>10} {'process s':>9}  " \
             f"re-splits (at update)"
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as workdir:
        for setup in setups:
            outcome = run(setup, args.updates, args.sample_ms, Path(workdir))
            records = outcome.records
            steady, efficiency = throughput(records, args.steady_from)
            whole, _ = throughput(records, 0)
            probe = probe_seconds(outcome.lines)
            samples = args.updates * GLOBAL_BATCH
            with_probe = samples / (samples / whole + probe)
            split = ",".join(map(str, final_split(records)))
            print(f"{setup.name:<24} {split:<14} {efficiency:>11.3f} {steady:>10.1f} {steady / ideal:>9.3f} "
                  f"{whole / ideal:>10.3f} {probe:>8.2f} {with_probe / ideal:>8.3f} "
                  f"{wall_clock(records) / ideal:>10.3f} {outcome.seconds:>9.1f}  {resplits(records)}", flush=True)


if __name__ == "__main__":
    main()

"""Stress the end of distributed runs: many short local jobs, counting ranks that abort at teardown.

Issue 12, item 7: about one run in several hundred ended with a rank killed by SIGABRT
("terminate called without an active exception") while the process group was torn down.
This runs ``--runs`` short ``--ranks``-process jobs one after another (toy task, a few
updates, validation and a checkpoint, so every collective and the teardown run) and prints
how many ended cleanly, how many had a rank abort, and how many failed otherwise.

    python benchmarks/stress_teardown.py --runs 200            # about 1 hour on 2 busy cores
    PYTHONPATH=/path/to/old/checkout python benchmarks/stress_teardown.py --runs 200   # another version

Not a test: it takes long and its result is a count, not a pass/fail.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOY_PLUGIN = REPO / "tests" / "toy_plugin"
ABORT_MARKERS = ("terminate called", "SIGABRT", "exited with code -6", "core dumped")


def job_command(ranks: int, save_dir: Path) -> list[str]:
    return [sys.executable, "-m", "hetfair_cli.train", "--user-dir", str(TOY_PLUGIN), "--task", "toy",
            "--toy-train-size", "96", "--max-sentences", "8", "--max-update", "3", "--save-dir", str(save_dir),
            "--no-epoch-checkpoints", "--log-format", "none", "--distributed-world-size", str(ranks),
            "--distributed-timeout", "120"]


def run_once(ranks: int, timeout: float) -> tuple[str, float, str]:
    """One job: ``ok``, ``abort`` (a rank died of SIGABRT), ``hang`` or ``failed``; its seconds; stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory(prefix="hetfair-stress-") as workdir:
        began = time.monotonic()
        try:
            result = subprocess.run(job_command(ranks, Path(workdir) / "ckpt"), cwd=workdir, env=env,
                                    capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            return "hang", time.monotonic() - began, str(exc.stderr or "")
        seconds = time.monotonic() - began
    if any(marker in result.stderr for marker in ABORT_MARKERS):
        return "abort", seconds, result.stderr
    return ("ok" if result.returncode == 0 else "failed"), seconds, result.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600, help="seconds before a job counts as hung")
    parser.add_argument("--log", type=Path, help="append each job's outcome (and stderr of bad ones) here")
    args = parser.parse_args()
    counts = {"ok": 0, "abort": 0, "hang": 0, "failed": 0}
    durations = []
    for run in range(1, args.runs + 1):
        outcome, seconds, stderr = run_once(args.ranks, args.timeout)
        counts[outcome] += 1
        durations.append(seconds)
        tally = " ".join(f"{k} {v}" for k, v in counts.items())
        line = f"run {run}/{args.runs}: {outcome} in {seconds:.1f}s | {tally}"
        print(line, flush=True)
        if args.log is not None:
            with args.log.open("a") as log:
                log.write(line + "\n" + (stderr if outcome != "ok" else ""))
    durations.sort()
    print(f"\n{args.runs} jobs of {args.ranks} ranks: {counts['ok']} clean, {counts['abort']} with a rank aborted "
          f"(SIGABRT), {counts['hang']} hung, {counts['failed']} failed otherwise; "
          f"median {durations[len(durations) // 2]:.1f}s per job")


if __name__ == "__main__":
    main()

"""Stress the end of distributed runs: many short local jobs, counting ranks that abort at teardown.

Issue 12, item 7: about one run in several hundred ended with a rank killed by SIGABRT
("terminate called without an active exception") while the process group was torn down.
This runs ``--runs`` short ``--ranks``-process jobs one after another (toy task, a few
updates, validation and a checkpoint, so every collective and the teardown run) and prints
how many ended cleanly, how many had a rank abort, and how many failed otherwise.

    python benchmarks/stress_teardown.py --runs 200            # about 1 hour on 2 busy cores
    PYTHONPATH=/path/to/old/checkout python benchmarks/stress_teardown.py --runs 200   # another version

``--stop`` stresses the other end instead: each job (``--num-workers`` DataLoader workers per
rank) trains until its first progress line, gets SIGINT, and counts as ``ok`` when it exits
130 with no traceback and no "leaked semaphore" warning; the seconds from the signal until
the command's output closes (every process holding it gone) are reported. ``--load N`` runs
N busy processes meanwhile, to measure that time on a loaded machine.

    python benchmarks/stress_teardown.py --stop --ranks 8 --num-workers 2 --runs 20 --load 16

Not a test: it takes long and its result is a count, not a pass/fail.
"""

from __future__ import annotations

import argparse
import os
import signal
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


def stop_command(ranks: int, num_workers: int, save_dir: Path) -> list[str]:
    return [sys.executable, "-m", "hetfair_cli.train", "--user-dir", str(TOY_PLUGIN), "--task", "toy",
            "--toy-train-size", "100000", "--max-epoch", "50", "--save-dir", str(save_dir), "--log-format", "simple",
            "--log-interval", "1", "--disable-validation", "--distributed-world-size", str(ranks),
            "--num-workers", str(num_workers)]


def stop_once(ranks: int, num_workers: int, timeout: float) -> tuple[str, float, str]:
    """One job stopped by SIGINT once it trains: ``ok``, ``leak``, ``noisy`` (a traceback), ``hang`` or ``failed``;
    the seconds from the signal until its output closed; its stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory(prefix="hetfair-stress-") as workdir:
        proc = subprocess.Popen(stop_command(ranks, num_workers, Path(workdir) / "ckpt"), cwd=workdir, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("train_inner"):
                break
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        try:
            _, rest = proc.communicate(timeout=timeout)  # until every holder of stderr is gone
        except subprocess.TimeoutExpired:
            proc.kill()
            return "hang", time.monotonic() - sent, "".join(lines)
        seconds = time.monotonic() - sent
    stderr = "".join(lines) + rest
    if "leaked semaphore" in stderr:
        return "leak", seconds, stderr
    if "Traceback" in stderr:
        return "noisy", seconds, stderr
    return ("ok" if proc.returncode == 130 else "failed"), seconds, stderr


def busy_processes(count: int) -> list[subprocess.Popen]:
    """``count`` processes that only burn CPU, for a machine under load."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


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
    parser.add_argument("--timeout", type=float, default=600, help="seconds before a job (or its stop) counts as hung")
    parser.add_argument("--log", type=Path, help="append each job's outcome (and stderr of bad ones) here")
    parser.add_argument("--stop", action="store_true", help="stop each job with SIGINT while it trains")
    parser.add_argument("--num-workers", type=int, default=2, help="DataLoader workers per rank (with --stop)")
    parser.add_argument("--load", type=int, default=0, help="busy processes running meanwhile")
    args = parser.parse_args()
    outcomes = ("ok", "leak", "noisy", "hang", "failed") if args.stop else ("ok", "abort", "hang", "failed")
    counts = dict.fromkeys(outcomes, 0)
    durations = []
    load = busy_processes(args.load)
    try:
        for run in range(1, args.runs + 1):
            outcome, seconds, stderr = (stop_once(args.ranks, args.num_workers, args.timeout) if args.stop
                                        else run_once(args.ranks, args.timeout))
            counts[outcome] += 1
            durations.append(seconds)
            tally = " ".join(f"{k} {v}" for k, v in counts.items())
            line = f"run {run}/{args.runs}: {outcome} in {seconds:.1f}s | {tally} | load {os.getloadavg()[0]:.0f}"
            print(line, flush=True)
            if args.log is not None:
                with args.log.open("a") as log:
                    log.write(line + "\n" + (stderr if outcome != "ok" else ""))
    finally:
        for process in load:
            process.kill()
            process.wait()
    durations.sort()
    if args.stop:
        print(f"\n{args.runs} jobs of {args.ranks} ranks x {args.num_workers} DataLoader workers stopped by SIGINT: "
              f"{counts['ok']} clean, {counts['leak']} leaked semaphores, {counts['noisy']} printed a traceback, "
              f"{counts['hang']} hung, {counts['failed']} failed otherwise; output closed after median "
              f"{durations[len(durations) // 2]:.1f}s, at most {durations[-1]:.1f}s")
        return
    print(f"\n{args.runs} jobs of {args.ranks} ranks: {counts['ok']} clean, {counts['abort']} with a rank aborted "
          f"(SIGABRT), {counts['hang']} hung, {counts['failed']} failed otherwise; "
          f"median {durations[len(durations) // 2]:.1f}s per job")


if __name__ == "__main__":
    main()

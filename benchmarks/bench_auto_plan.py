"""The automatic plan vs the best hand-tuned command, on a simulated cluster of speeds 1:1:2:4 and memory 1:2.

Four hetfair-train processes of ``benchmarks/simcluster`` (forward passes sleep in proportion to the
batch over each rank's speed; ``--sim-hidden 65536`` makes each sample hold about 0.9M, so memory
binds). Ranks 0 and 1 (speed 1) have the large budget, ranks 2 and 3 (speeds 2 and 4) half of it:
the fastest rank cannot take its speed's share. Both set-ups train the same global batch:

- **auto**: the one command every node would run, ``--max-sentences auto --memory-budget ...
  --auto-balance --ddp-backend auto --precision auto``;
- **hand-tuned**: the best static command a user could write knowing every rank's limit: the largest
  micro-batch that fits each budget (the probe's own finding, without its 5% margin) and the split by
  speed within those limits (``split_counts``), as ``--max-sentences`` with the global batch their sum.

Throughput is samples/s of wall-clock time between log lines from ``--steady-from`` on ("whole run":
all updates, the balancer's measuring phase included); the set-ups alternate for ``--rounds``. "peak
RSS" is each rank's resident high-water mark (``VmHWM``, polled; the probe resets it, so it covers
training after the probe) against its budget: on CPU "no OOM" means training stayed within it. Both
set-ups run with glibc's mmap threshold fixed at 128K (``MALLOC_MMAP_THRESHOLD_``): freed activations
go back to the system at once, as they would be reused by a GPU's caching allocator; with glibc's
default, heap fragments as the balancer changes batch sizes and the resident set grows above what
any step holds (the small ranks reached 700M of 450M). The
probe's share of a 1,000-update run is extrapolated: the slowest rank's probing seconds (the ``plan |``
line) over 1,000 times the steady seconds per update.

    python benchmarks/bench_auto_plan.py [--updates 60] [--sample-ms 2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import Samples, machine_note, print_table, rank_pids, ratio

from hetfair.data.batch_plan import split_counts
from hetfair.memory.sizes import format_size, parse_size

SIMCLUSTER = Path(__file__).resolve().parent / "simcluster"
SPEEDS = [1, 1, 2, 4]
BUDGETS = ["900M", "900M", "450M", "450M"]
GLOBAL_BATCH = 512
LOG_INTERVAL = 10
PROBE_LINE = re.compile(r"probing took ([\d.]+) s")


def common_flags(updates: int, sample_ms: float) -> list[str]:
    return ["--user-dir", str(SIMCLUSTER), "--task", "sim", "--sim-train-size", str(GLOBAL_BATCH * 4),
            "--sim-hidden", "65536", "--sim-speeds", ",".join(map(str, SPEEDS)), "--sim-sample-ms", str(sample_ms),
            "--optimizer", "sgd", "--lr", "0.05", "--global-batch-size", str(GLOBAL_BATCH),
            "--max-update", str(updates), "--no-save", "--disable-validation", "--log-format", "json",
            "--log-interval", str(LOG_INTERVAL), "--distributed-world-size", str(len(SPEEDS))]


def auto_flags() -> list[str]:
    return ["--max-sentences", "auto", "--memory-budget", ",".join(BUDGETS), "--auto-balance",
            "--ddp-backend", "auto", "--precision", "auto"]


class PeakWatch:
    """Polls the resident high-water mark (``VmHWM``) of a launcher's rank processes while it runs."""

    def __init__(self, launcher: int) -> None:
        self.launcher = launcher
        self.peaks: dict[int, int] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.done.wait(0.2):
            for pid in self._ranks():
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
                if found:
                    self.peaks[pid] = int(found.group(1)) * 1024

    def _ranks(self) -> list[int]:
        return rank_pids(self.launcher)

    def stop(self) -> list[int]:
        """Each rank's last-seen peak, in rank order."""
        self.done.set()
        self.thread.join()
        return [self.peaks[pid] for pid in sorted(self.peaks)]


def run(flags: list[str], workdir: Path) -> tuple[list[dict[str, Any]], str, list[int]]:
    """One job; rank 0's JSON records, its other output, and each rank's peak resident memory."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    proc = subprocess.Popen([sys.executable, "-m", "hetfair_cli.train", *flags], cwd=workdir, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watch = PeakWatch(proc.pid)
    _, err = proc.communicate()
    peaks = watch.stop()
    if proc.returncode != 0:
        raise SystemExit(f"a run failed:\n{err}")
    records = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    return records, "\n".join(line for line in err.splitlines() if not line.startswith("{")), peaks


def throughput(records: list[dict[str, Any]], first_update: int) -> tuple[float, float]:
    """Samples/s and seconds per update over the log intervals that start at or after ``first_update``."""
    window = [r for r in records if r["phase"] == "train_inner" and r["num_updates"] - LOG_INTERVAL >= first_update]
    seconds = sum(LOG_INTERVAL / r["ups"] for r in window)
    return sum(LOG_INTERVAL * r["bsz"] for r in window) / seconds, seconds / (LOG_INTERVAL * len(window))


def plan_of(output: str) -> tuple[list[int], list[int], float]:
    """The auto run's micro-batches, the largest that fitted each rank, and the slowest rank's probing seconds."""
    rows = [line.split(" | ") for line in output.splitlines() if re.match(r"plan \| \d", line)]
    caps = [int(row[6]) for row in rows]
    fitted = [int(m.group(1)) if (m := re.search(r"probed: (\d+) fit", row[9])) else cap
              for row, cap in zip(rows, caps)]
    probe = PROBE_LINE.search(output)
    return caps, fitted, float(probe.group(1)) if probe else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=60)
    parser.add_argument("--sample-ms", type=float, default=2.0, help="milliseconds per sample at speed 1")
    parser.add_argument("--steady-from", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2, help="alternating auto / hand-tuned rounds")
    options = parser.parse_args()
    speed = {name: Samples() for name in ("auto", "hand")}
    whole = {name: Samples() for name in ("auto", "hand")}
    probe_share, notes = Samples(), []
    peaks: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-auto-plan-") as tmp:
        workdir = Path(tmp)
        hand_caps: list[int] = []
        for _ in range(options.rounds):
            records, output, peaks["auto"] = run(common_flags(options.updates, options.sample_ms) + auto_flags(),
                                                 workdir)
            caps, fitted, probe_seconds = plan_of(output)
            steady, update_seconds = throughput(records, options.steady_from)
            speed["auto"].add(steady)
            whole["auto"].add(throughput(records, 0)[0])
            probe_share.add(probe_seconds / (1000 * update_seconds))
            hand_caps = split_counts(GLOBAL_BATCH, SPEEDS, fitted)
            notes.append(f"auto plan: micro-batches {caps} (largest that fitted {fitted}); probing "
                         f"{probe_seconds:.1f} s; hand-tuned --max-sentences {','.join(map(str, hand_caps))}")
            records, _, peaks["hand"] = run(common_flags(options.updates, options.sample_ms)
                                            + ["--max-sentences", ",".join(map(str, hand_caps))], workdir)
            speed["hand"].add(throughput(records, options.steady_from)[0])
            whole["hand"].add(throughput(records, 0)[0])
    budgets = [parse_size(b) for b in BUDGETS]
    rows = [(name, f"{speed[name].median:.1f}", speed[name].spread("{:.1f}"), f"{whole[name].median:.1f}",
             f"{ratio(speed[name].median, speed['hand'].median):.3f}",
             " ".join(format_size(p) for p in peaks.get(name, [])))
            for name in ("auto", "hand")]
    within = all(p <= b for p, b in zip(peaks.get("auto", []), budgets))
    print_table(f"speeds {SPEEDS}, budgets {BUDGETS}, global batch {GLOBAL_BATCH}, {options.updates} updates, "
                f"{options.sample_ms:g} ms/sample at speed 1, {options.rounds} alternating rounds",
                ["set-up", "samples/s", "spread", "whole run", "of hand-tuned", "peak RSS per rank"], rows,
                notes + [f"auto stayed within every budget: {within}",
                         f"probing / (1,000 updates x steady s/update): {probe_share.median:.2%} "
                         f"({probe_share.spread('{:.2%}')}), extrapolated from the measured update time",
                         machine_note()])


if __name__ == "__main__":
    main()

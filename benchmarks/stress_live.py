"""Repeat the live-recovery scenarios (tests/test_live_recovery.py) and count the failures of each.

CI runs every scenario once; issue 27 asks for five runs without a failure. Each round is one pytest
run of the process scenarios (kill and replace, the donor killed, SIGSTOP, a majority lost, the
lighthouse lost), so every run starts from fresh processes and a fresh lighthouse.

    python benchmarks/stress_live.py [--repeat 5] [--loopback-namespace] [-k EXPRESSION]

``--loopback-namespace`` runs them in a network namespace that has only ``lo`` (as root; tests/netns.py),
where every connection's peer lacks a DNS name and torch warns about it on each: no rank or lighthouse
line may be such a warning. ``-k`` chooses scenarios as pytest's ``-k`` does.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import secrets
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from netns import unavailable  # noqa: E402  (tests/ on the path first)

OUTCOME = re.compile(r"^tests/test_live_recovery\.py::(\S+) (PASSED|FAILED|ERROR)", re.MULTILINE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--loopback-namespace", action="store_true", help="run in a namespace with only lo")
    parser.add_argument("-k", dest="scenarios", default="not refused", help="pytest -k expression")
    options = parser.parse_args()
    passed: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with namespace(options.loopback_namespace) as prefix:
        for run in range(1, options.repeat + 1):
            result = subprocess.run([*prefix, sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
                                     "tests/test_live_recovery.py", "-k", options.scenarios],
                                    cwd=REPO, env=env, capture_output=True, text=True)
            report(run, result, passed, failed)
    print(f"load average {os.getloadavg()[0]:.1f} (1 min) at the end")
    for name in sorted(set(passed) | set(failed)):
        print(f"{name}: {passed[name]} passed, {failed[name]} failed of {options.repeat}")


@contextmanager
def namespace(wanted: bool) -> Iterator[list[str]]:
    """The command prefix that runs in a fresh namespace with only ``lo`` up (removed after), or none."""
    if not wanted:
        yield []
        return
    reason = unavailable()
    if reason:
        raise SystemExit(f"stress_live.py: {reason}")
    name = f"hetfair-stress-{secrets.token_hex(4)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield ["ip", "netns", "exec", name]
    finally:
        subprocess.run(["ip", "netns", "del", name])


def report(run: int, result: subprocess.CompletedProcess, passed: Counter[str], failed: Counter[str]) -> None:
    """Count one pytest run's outcomes; print its output where it failed."""
    for name, outcome in OUTCOME.findall(result.stdout):
        (passed if outcome == "PASSED" else failed)[name] += 1
    print(f"run {run}: {'ok' if result.returncode == 0 else 'FAILED'}", file=sys.stderr, flush=True)
    if result.returncode != 0:
        print(result.stdout, file=sys.stderr)


if __name__ == "__main__":
    main()

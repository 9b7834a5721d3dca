"""Recovery time of elastic runs under torchrun: from a kill to the first update after the restart.

Two torchrun agents on this machine stand in for two nodes (c10d rendezvous, one hetfair-train
worker each, the MNIST plugin on Fashion-MNIST). Once both train, the script kills either
agent B's rank process ("worker killed": both restart on two nodes) or agent B itself with
SIGKILL ("node killed": A goes on alone), and clocks the first ``train_inner`` line of agent A
after its ``restore`` line. B starts once A holds the rendezvous (torchrun's c10d store lives in
the agent that opened ``--rdzv-endpoint``; killing that one ends the job), so B joins a running
job: that needs ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (see docs/elastic.md, "Elastic and
preemptible runs"), set here. The scenarios alternate; the table gives successes, the median
recovery (min..max) and the updates redone (done before the kill, lost with it).

    python benchmarks/bench_elastic.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import descendants, free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")
RDZV_CONF = "join_timeout=60,last_call_timeout=1,close_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"
SCENARIOS = ("worker killed", "node killed")
UPDATES = re.compile(r"num_updates (\d+)")
WAIT = 180.0


@dataclass
class Agent:
    """One torchrun agent and the lines of its output, each with the time it arrived."""

    process: subprocess.Popen
    lines: list[tuple[float, str]] = field(default_factory=list)

    def read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line))


def start_agent(port: int, save_dir: Path, env: dict[str, str]) -> Agent:
    command = [str(TORCHRUN), "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench", "--rdzv-conf", RDZV_CONF,
               "--max-restarts", "3", "--monitor-interval", "0.5", "-m", "hetfair_cli.train",
               "--user-dir", str(REPO / "plugins"), "--task", "mnist", "--dataset", "fashion-mnist",
               "--arch", "mnist_mlp", "--max-sentences", "32", "--max-epoch", "0", "--max-update", "100000", "--save-dir", str(save_dir),
               "--save-interval-updates", "1", "--no-epoch-checkpoints", "--keep-interval-updates", "2",
               "--disable-validation", "--log-format", "simple", "--log-interval", "1",
               "--distributed-timeout", "60"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    agent = Agent(process)
    threading.Thread(target=agent.read, daemon=True).start()
    return agent


def wait_for(agent: Agent, since: float, pattern: str) -> tuple[float, str]:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        for seen, line in list(agent.lines):
            if seen >= since and pattern in line:
                return seen, line
        time.sleep(0.01)
    raise TimeoutError(pattern)


def wait_until_listening(port: int) -> None:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"a rendezvous on port {port}")


def one_recovery(scenario: str) -> Optional[tuple[float, int]]:
    """Seconds from the kill to A's first update after its restore, and the updates redone; None: no recovery."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    port = free_port()
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        agents = [start_agent(port, Path(tmp) / "ckpt", env)]
        try:
            wait_until_listening(port)  # A holds the rendezvous (torchrun's c10d store): it must not be B
            agents.append(start_agent(port, Path(tmp) / "ckpt", env))
            started, _ = wait_for(agents[0], 0.0, "world_size 2 |")
            wait_for(agents[0], started, "train_inner")
            time.sleep(1.0)  # a few updates in
            killed = time.monotonic()
            if scenario == "worker killed":
                ranks = [p for p in descendants(agents[1].process.pid)
                         if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
                os.kill(ranks[0], signal.SIGKILL)
            else:
                agents[1].process.kill()
            restored, line = wait_for(agents[0], killed, "restore |")
            first, _ = wait_for(agents[0], restored, "train_inner")
            before = [seen_line for seen, seen_line in list(agents[0].lines) if seen < restored]
            done = max(int(UPDATES.search(l).group(1)) for l in before if "train_inner" in l)
            return first - killed, done - int(UPDATES.search(line).group(1))
        except TimeoutError as missing:
            tail = [line.rstrip()[:200] for _, line in agents[0].lines if "train_inner" not in line][-6:]
            print(f"no '{missing}' within {WAIT:.0f}s; agent A's last lines:", *tail, sep="\n  ", file=sys.stderr)
            return None
        finally:
            for agent in agents:
                try:
                    os.killpg(agent.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                agent.process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    options = parser.parse_args()
    results: dict[str, list[Optional[tuple[float, int]]]] = {}
    for _ in range(options.repeat):
        for scenario in SCENARIOS:
            outcome = one_recovery(scenario)
            results.setdefault(scenario, []).append(outcome)
            print(f"{scenario:14} | {outcome}", file=sys.stderr, flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} (1 min) at the end; recovery = kill -> first update after restart")
    print(f"{'scenario':14} | {'ok':>5} | {'median s':>8} | {'min..max s':>11} | redone")
    for scenario, outcomes in results.items():
        good = [o for o in outcomes if o is not None]
        seconds = [s for s, _ in good]
        spread = f"{min(seconds):.1f}..{max(seconds):.1f}" if seconds else "-"
        median = f"{statistics.median(seconds):.1f}" if seconds else "-"
        redone = f"{statistics.median([r for _, r in good]):.0f}" if good else "-"
        print(f"{scenario:14} | {len(good):>2}/{len(outcomes):<2} | {median:>8} | {spread:>11} | {redone}")


if __name__ == "__main__":
    main()

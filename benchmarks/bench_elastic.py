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

Beside them, the same two processes under ``--fault-tolerance live`` (a lighthouse, one hetfair-train
command per rank, no torchrun): "rank killed" kills the rank that is not rank 0 and clocks rank 0's first
update in the new round (the updates redone are those of the update in flight); "rank joins" then
starts a replacement and clocks from its start to rank 0's first update with it. The throughput at a
failure every N updates is derived from the two: N updates take N / ups + the recovery. The
steady-state overhead compares live and plain (``--fault-tolerance none``) two-process runs without
failures, alternating, by the time of updates 50 to 250.

    python benchmarks/bench_elastic.py [--repeat 3] [--every 1000]
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
from typing import Iterable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import free_port, rank_pids  # noqa: E402

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
                ranks = rank_pids(agents[1].process.pid)
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
            stop_all(agents)


WORKER = ["-m", "hetfair_cli.train", "--user-dir", str(REPO / "plugins"), "--task", "mnist", "--dataset",
          "fashion-mnist", "--arch", "mnist_mlp", "--max-sentences", "32", "--max-epoch", "0",
          "--no-epoch-checkpoints", "--disable-validation", "--log-format", "simple", "--log-interval", "1",
          "--distributed-timeout", "60"]
ROUND = re.compile(r"live \| round (\d+): rank (\d+) of (\d+) .* from (?:update (\d+)|the start)")


def start_command(arguments: list[str], env: dict[str, str]) -> Agent:
    process = subprocess.Popen([sys.executable, *arguments], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    agent = Agent(process)
    threading.Thread(target=agent.read, daemon=True).start()
    return agent


def start_lighthouse(env: dict[str, str]) -> tuple[Agent, str]:
    lighthouse = start_command(["-m", "hetfair_cli.lighthouse", "--port", "0"], env)
    _, line = wait_for(lighthouse, 0.0, "listening on port")
    return lighthouse, f"tcp://127.0.0.1:{line.split()[-1]}"


def live_rank(address: str, save_dir: Path, env: dict[str, str], max_update: int = 100000) -> Agent:
    return start_command([*WORKER, "--save-dir", str(save_dir), "--max-update", str(max_update),
                          "--fault-tolerance", "live", "--distributed-world-size", "2",
                          "--distributed-init-method", address], env)


def rank_of(agent: Agent, round_number: int) -> int:
    _, line = wait_for(agent, 0.0, f"live | round {round_number}: rank")
    return int(ROUND.search(line).group(2))  # type: ignore[union-attr]


def stop_all(agents: list[Agent]) -> None:
    for agent in agents:
        try:
            os.killpg(agent.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        agent.process.wait()


def live_recovery() -> Optional[tuple[float, int, float]]:
    """Live: seconds from killing rank 1 to rank 0's next update, the updates redone, and seconds from starting a
    replacement to rank 0's first update with it; None: no recovery."""
    env = bench_env()
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        lighthouse, address = start_lighthouse(env)
        agents = [lighthouse] + [live_rank(address, Path(tmp) / "ckpt", env) for _ in range(2)]
        try:
            master, other = sorted(agents[1:], key=lambda agent: rank_of(agent, 1))
            started, _ = wait_for(master, 0.0, "train_inner")
            time.sleep(1.0)  # a few updates in
            killed = time.monotonic()
            other.process.kill()
            regrouped, line = wait_for(master, killed, "live | round 2: rank 0 of 1")
            first, _ = wait_for(master, regrouped, "train_inner")
            done = max(int(UPDATES.search(l).group(1))  # type: ignore[union-attr]
                       for seen, l in list(master.lines) if seen < killed and "train_inner" in l)
            redone = done - int(ROUND.search(line).group(4))  # type: ignore[union-attr, arg-type]
            joining = time.monotonic()
            agents.append(live_rank(address, Path(tmp) / "ckpt", env))
            joined, _ = wait_for(master, joining, "live | round 3: rank 0 of 2")
            trained, _ = wait_for(master, joined, "train_inner")
            return first - killed, max(redone, 0), trained - joining
        except TimeoutError as missing:
            print(f"live: no '{missing}' within {WAIT:.0f}s", file=sys.stderr)
            return None
        finally:
            stop_all(agents)


def steady_seconds(live: bool) -> float:
    """Seconds of updates 50 to 250 of two processes without failures, live or plain."""
    env = bench_env()
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        agents: list[Agent] = []
        try:
            if live:
                lighthouse, address = start_lighthouse(env)
                agents = [lighthouse] + [live_rank(address, Path(tmp) / "ckpt", env, 250) for _ in range(2)]
                master = min(agents[1:], key=lambda agent: rank_of(agent, 1))
            else:
                agents = [start_command([*WORKER, "--save-dir", str(Path(tmp) / "ckpt"), "--max-update", "250",
                                         "--distributed-world-size", "2"], env)]
                master = agents[0]
            at_50, _ = wait_for(master, 0.0, "num_updates 50 |")
            at_250, _ = wait_for(master, at_50, "num_updates 250 |")
            return at_250 - at_50
        finally:
            stop_all(agents)


def spread(values: Iterable[float]) -> str:
    seen = list(values)
    return f"{min(seen):.1f}..{max(seen):.1f}"


def bench_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def live_table(repeat: int, every: int) -> None:
    recoveries = []
    steady: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeat):
        recoveries.append(live_recovery())
        print(f"live           | {recoveries[-1]}", file=sys.stderr, flush=True)
        for live in (True, False):
            steady[live].append(steady_seconds(live))
    good = [r for r in recoveries if r is not None]
    live_s, plain_s = statistics.median(steady[True]), statistics.median(steady[False])
    print(f"live recovery, 2 processes: ok {len(good)}/{len(recoveries)}; load average {os.getloadavg()[0]:.1f}")
    if good:
        lost, redone, join = (statistics.median(column) for column in zip(*good))
        ups = 200 / live_s
        print(f"  rank killed: {lost:.1f} s to the next update ({spread(r[0] for r in good)}), "
              f"{redone:.0f} update(s) redone")
        print(f"  rank joins: {join:.1f} s from its start to its first update ({spread(r[2] for r in good)})")
        print(f"  a failure every {every} updates: {every / (every / ups + lost):.1f} updates/s "
              f"vs {ups:.1f} without (derived: {every} / ({every} / ups + recovery))")
    print(f"  steady state, updates 50-250: live {live_s:.2f} s, plain {plain_s:.2f} s: "
          f"overhead {100 * (live_s / plain_s - 1):+.1f}% (medians of {repeat})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--every", type=int, default=1000, help="updates between failures, for the throughput")
    parser.add_argument("--live-only", action="store_true", help="skip the torchrun restarts")
    options = parser.parse_args()
    if options.live_only:
        live_table(options.repeat, options.every)
        return
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
    live_table(options.repeat, options.every)


if __name__ == "__main__":
    main()

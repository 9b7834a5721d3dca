"""Elastic runs under torchrun: nodes join and leave, the run continues exactly, nothing is orphaned.

Two torchrun agents on 127.0.0.1 stand in for two nodes (c10d rendezvous, one worker each).
One run goes through both membership changes: agent A starts alone, B joins, then B's whole
agent is killed (SIGKILL). After each, the workers restart and resume
from the newest checkpoint on the new world size, keeping the global batch (24 samples: two
steps of 12 when A, which holds 16, is alone). The final parameters must be those of a plain
PyTorch run over the same updates, and no process of the killed agent may survive it.
(Restarts after a killed worker, with the same members, are what benchmarks/bench_elastic.py
repeats; test_agent_store.py pins down why they once failed.)
The test holds training (a pause file the toy model waits on) while it changes the cluster,
so that every change lands mid-run however loaded the machine is. The SIGTERM with which torchrun
restarts a worker releases that hold: the worker saves after its update and stops, as a preempted
run does (held, it would sit out torchrun's 30 s shutdown grace and be killed).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import descendants, final_parameters, free_port, is_running, subprocess_env
from toy_reference import assert_same, reference_parameters, toy_train_args

TORCHRUN = Path(sys.executable).with_name("torchrun")
# a node that left is noticed within ~3s of missed heartbeats; a round closes 1s after its last join
RDZV_CONF = "join_timeout=60,last_call_timeout=1,close_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"
WAIT = 120.0


class Cluster:
    """torchrun agents sharing one rendezvous and one --save-dir, and the pause file their training waits on."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.save_dir = tmp_path / "ckpt"
        self.pause = tmp_path / "pause"
        self.port = free_port()
        self.agents: dict[str, subprocess.Popen] = {}

    def start(self, name: str) -> None:
        command = [str(TORCHRUN), "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", "elastic-test", "--rdzv-conf", RDZV_CONF,
                   "--max-restarts", "3", "--monitor-interval", "0.5", "-m", "hetfair_cli.train",
                   *toy_train_args(self.save_dir, 1, (
                       "--max-sentences", "16", "--global-batch-size", "24", "--save-interval-updates", "1",
                       "--toy-step-seconds", "0.05", "--toy-pause-file", str(self.pause), "--log-format", "simple"))]
        env = {**subprocess_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # else a joining node cannot meet
        log = open(self.tmp_path / f"{name}.log", "w")
        self.agents[name] = subprocess.Popen(command, cwd=self.tmp_path, env=env, stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True)

    def log(self, name: str) -> str:
        return (self.tmp_path / f"{name}.log").read_text()

    def wait(self, what: str, done) -> None:
        deadline = time.monotonic() + WAIT
        while not done():
            assert time.monotonic() < deadline, f"not within {WAIT:.0f}s: {what}\n{self.log('a')[-3000:]}"
            ended = [name for name, agent in self.agents.items() if agent.poll() is not None]
            assert not ended, f"agent {ended} ended before: {what}\n{self.log(ended[0])[-3000:]}"
            time.sleep(0.02)

    def newest_update(self) -> int:
        names = (re.fullmatch(r"checkpoint_\d+_(\d+)\.pt", p.name) for p in self.save_dir.glob("checkpoint_*_*.pt"))
        return max((int(m.group(1)) for m in names if m), default=0)

    def train_on(self, world_size: int, starts: int) -> None:
        """Let the workers train until the ``starts``-th start of the job (on ``world_size`` ranks) saved an update."""
        self.wait(f"start {starts} on {world_size} ranks",
                  lambda: self.log("a").count("setup | epoch") == starts)
        assert f"world_size {world_size} |" in self.log("a").split("setup | epoch")[-1]
        before = self.newest_update()
        self.pause.unlink(missing_ok=True)
        self.wait("an update saved", lambda: self.newest_update() > before)
        self.pause.touch()

    def close(self) -> None:
        for agent in self.agents.values():
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)


def test_a_run_that_gains_and_loses_nodes_ends_as_an_uninterrupted_one(tmp_path):
    cluster = Cluster(tmp_path)
    try:
        cluster.start("a")
        cluster.train_on(world_size=1, starts=1)  # A alone: each update is 2 steps of 12
        cluster.start("b")  # joins: A's worker restarts, both resume from A's last checkpoint
        cluster.train_on(world_size=2, starts=2)
        doomed = descendants(cluster.agents["b"].pid)
        cluster.agents.pop("b").kill()  # the whole node goes: A goes on alone
        cluster.pause.unlink()
        assert cluster.agents["a"].wait(timeout=WAIT) == 0, cluster.log("a")[-3000:]
        deadline = time.monotonic() + 30
        while any(is_running(pid) for pid in doomed) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid in doomed if is_running(pid)] == [], "processes of the killed agent live on"
    finally:
        cluster.close()
    log = cluster.log("a")
    assert log.count("restore |") == 2 and log.count("setup | epoch") == 3
    assert "world_size 1 |" in log.split("setup | epoch")[-1]
    assert "each update of 24 samples takes 2 steps of up to 12" in log
    assert_same(final_parameters(cluster.save_dir), reference_parameters(update_size=24))

"""Who can reach a job's rendezvous, and what the ranks obey.

A local ``--distributed-world-size N`` run opens no port that other machines can reach. A
store on another address needs the job's secret, and the ranks act only on check-in and
abort values signed with it. Every socket here is on 127.0.0.1; 203.0.113.5 (a documentation
address) is only ever parsed, never contacted.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from helpers import TOY_PLUGIN, free_port, rank_flags, subprocess_env, train_command, worker_pids
from hetfair.checkpoint import load_checkpoint
from hetfair.distributed.rendezvous import SECRET_ENV, StoreAddress, job_secret
from hetfair.errors import ConfigError
from hetfair_cli.train import main as train_main
from test_signals_and_hangs import long_run, wait_for_line


def listening_addresses(pids: list[int]) -> list[str]:
    """The local addresses of every listening TCP socket that one of ``pids`` holds."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # LISTEN
                found.append(_address(local.split(":")[0], width))
    return found


def _address(hex_address: str, width: int) -> str:
    raw = bytes.fromhex(hex_address)
    # /proc stores each 32-bit word in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def test_a_local_run_listens_on_loopback_only(tmp_path):
    launcher = subprocess.Popen(train_command(*long_run(tmp_path, "--distributed-world-size", "2")), cwd=tmp_path,
                                env={k: v for k, v in subprocess_env().items() if k != "GLOO_SOCKET_IFNAME"},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_line(launcher, "train_inner", within=240)
        addresses = listening_addresses([launcher.pid, *worker_pids(launcher.pid)])
    finally:
        os.kill(launcher.pid, signal.SIGTERM)
        launcher.communicate(timeout=60)
    assert addresses  # gloo's own connections
    assert all(ipaddress.ip_address(a).is_loopback for a in addresses), addresses


def test_a_store_other_machines_can_reach_needs_a_secret(tmp_path, capsys):
    public = StoreAddress("tcp", host="203.0.113.5", port=29500)
    with pytest.raises(ConfigError, match=f"same secret in the {SECRET_ENV} environment variable"):
        job_secret(None, public, {})
    assert job_secret(None, public, {SECRET_ENV: "s3cret"}) == b"s3cret"
    assert job_secret("given", public, {SECRET_ENV: "s3cret"}) == b"given"
    assert job_secret(None, StoreAddress("tcp", host="127.0.0.1", port=29500), {}) is None
    # through the command line: refused before any process starts
    code = train_main(["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--max-epoch", "1",
                       "--save-dir", str(tmp_path / "c"), "--distributed-world-size", "2", "--distributed-gpus", "1",
                       "--distributed-init-method", "tcp://203.0.113.5:29500"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and SECRET_ENV in err


def node(tmp_path: Path, rank: int, init: str, secret: str, timeout: int = 120) -> subprocess.Popen:
    args = ["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--max-epoch", "1", "--save-dir", str(tmp_path / "c"),
            "--log-format", "none", "--disable-validation", *rank_flags(rank, 2, init),
            "--distributed-timeout", str(timeout)]
    return subprocess.Popen(train_command(*args), cwd=tmp_path, env={**subprocess_env(), SECRET_ENV: secret},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_port(port: int, within: float) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port} after {within} s")


def test_an_abort_without_the_secret_is_ignored(tmp_path):
    port = free_port()
    init = f"tcp://127.0.0.1:{port}"
    rank0 = node(tmp_path, 0, init, "the job's secret")
    try:
        wait_for_port(port, within=120)
        outsider = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=30))
        assert outsider.get("hetfair/world_size")  # torch's store has no access control: keys are readable
        outsider.set("hetfair/abort", "INJECTED: stop the job")
        rank1 = node(tmp_path, 1, init, "the job's secret")
        results = [proc.communicate(timeout=300) for proc in (rank0, rank1)]
    finally:
        for proc in (rank0,):
            if proc.poll() is None:
                proc.kill()
    for proc, (_, err) in zip((rank0, rank1), results):
        assert proc.returncode == 0, err
        assert "INJECTED" not in err


def test_a_node_with_another_secret_is_not_admitted(tmp_path):
    port = free_port()
    init = f"tcp://127.0.0.1:{port}"
    procs = [node(tmp_path, 0, init, "secret A", timeout=10), node(tmp_path, 1, init, "secret B", timeout=10)]
    results = [proc.communicate(timeout=300) for proc in procs]
    for proc, (_, err) in zip(procs, results):
        assert proc.returncode == 2
        lines = err.strip().splitlines()
        assert len(lines) == 1 and f"not signed with this node's secret: give every node the same {SECRET_ENV}" \
            in lines[0], err


def test_the_secret_is_never_stored_in_a_checkpoint(tmp_path):
    assert train_main(["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--max-update", "1", "--log-format", "none",
                       "--save-dir", str(tmp_path / "c"), "--distributed-secret", "do-not-store-me"]) == 0
    config = load_checkpoint(tmp_path / "c" / "checkpoint_last.pt")["config"]
    assert "distributed_secret" not in config
    assert b"do-not-store-me" not in (tmp_path / "c" / "checkpoint_last.pt").read_bytes()

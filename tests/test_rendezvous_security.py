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
import stat
import subprocess
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from helpers import TOY_PLUGIN, free_port, rank_flags, subprocess_env, train_command, worker_pids
from hetfair.checkpoint.layout import load_checkpoint
from hetfair.launch.check_in import CheckIn, Signer
from hetfair.launch.rendezvous import SECRET_ENV, StoreAddress, job_secret
from hetfair.launch.user_secret import secret_directory, user_secret
from hetfair.errors import ConfigError, DistributedError
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
    assert job_secret(None, StoreAddress("tcp", host="127.0.0.1", port=29500), {}) == user_secret()
    # through the command line: refused before any process starts
    code = train_main(["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--max-epoch", "1",
                       "--save-dir", str(tmp_path / "c"), "--distributed-world-size", "2", "--distributed-gpus", "1",
                       "--distributed-init-method", "tcp://203.0.113.5:29500"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and SECRET_ENV in err


def test_a_loopback_job_without_a_secret_uses_this_users_own(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    secret = user_secret()
    assert len(secret) == 64 and user_secret() == secret
    assert stat.S_IMODE((secret_directory() / "loopback-secret").stat().st_mode) == 0o600
    assert stat.S_IMODE(secret_directory().stat().st_mode) == 0o700
    secret_directory().chmod(0o755)  # e.g. made by someone else: refused
    with pytest.raises(ConfigError, match="is not private to you"):
        user_secret()


def node(tmp_path: Path, rank: int, init: str, secret: str | None, timeout: int = 120) -> subprocess.Popen:
    """Rank ``rank`` of a 2-rank toy job meeting at ``init`` (``env://``: as torchrun starts it, see below)."""
    args = ["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--max-epoch", "1", "--save-dir", str(tmp_path / "c"),
            "--log-format", "none", "--disable-validation", "--distributed-timeout", str(timeout)]
    env = {k: v for k, v in subprocess_env().items() if k != SECRET_ENV}
    if init.startswith("env://"):
        env.update(torchrun_env(rank, 2, init[len("env://"):]))
    else:
        args += rank_flags(rank, 2, init)
    if secret is not None:
        env[SECRET_ENV] = secret
    return subprocess.Popen(train_command(*args), cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def torchrun_env(rank: int, world_size: int, master: str) -> dict[str, str]:
    """What torchrun (c10d rendezvous, its store shared with the workers) sets for one worker per node."""
    host, port = master.split(":")
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": str(rank), "MASTER_ADDR": host, "MASTER_PORT": port, "TORCHELASTIC_RUN_ID": "test",
            "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "0"}


def wait_for_port(port: int, within: float) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port} after {within} s")


def job_store(init: str) -> dist.TCPStore:
    """An outsider's client of the store rank 0 of a job at ``init`` hosts, once it is up.

    Under torchrun that is the store of this start, which rank 0 publishes in torchrun's.
    """
    port = int(init.rsplit(":", 1)[1])
    wait_for_port(port, within=120)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=120))
    if init.startswith("env://"):
        published = store.get("hetfair/worker_store").decode()  # [signature:]port|nonce
        port = int(published.rsplit(":", 1)[-1].split("|")[0])
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=30))
    store.wait(["hetfair/world_size"])
    return store


def published_nonce(store: dist.TCPStore) -> str:
    return store.get("hetfair/world_size").decode().rsplit("|", 1)[1]  # torch's store: every key is readable


@pytest.mark.parametrize("rendezvous, secret", [("tcp", "the job's secret"), ("tcp", None), ("env", None)],
                         ids=["tcp-with-secret", "loopback-tcp", "loopback-torchrun"])
def test_a_client_without_the_secret_cannot_abort_the_job(tmp_path, rendezvous, secret):
    port = free_port()
    init = f"{rendezvous}://127.0.0.1:{port}"
    agent = []
    if rendezvous == "env":  # torchrun's agent store, which the workers share
        agent.append(dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False))
    rank0 = node(tmp_path, 0, init, secret)
    try:
        job_store(init).set("hetfair/abort", "INJECTED: stop the job")
        rank1 = node(tmp_path, 1, init, secret)
        results = [proc.communicate(timeout=300) for proc in (rank0, rank1)]
    finally:
        if rank0.poll() is None:
            rank0.kill()
    for proc, (_, err) in zip((rank0, rank1), results):
        assert proc.returncode == 0, err
        assert "INJECTED" not in err


def test_a_fake_arrival_does_not_complete_a_loopback_jobs_check_in(tmp_path):
    init = f"tcp://127.0.0.1:{free_port()}"
    rank0 = node(tmp_path, 0, init, None, timeout=5)
    try:
        outsider = job_store(init)
        outsider.set("hetfair/arrived/1", published_nonce(outsider))  # rank 1 never starts
        _, err = rank0.communicate(timeout=120)
    finally:
        if rank0.poll() is None:
            rank0.kill()
    assert rank0.returncode == 2
    assert err.strip().splitlines() == [
        f"hetfair-train: error: [rank 0] only 1 of 2 processes joined within 5s; start every node's command with "
        f"the same --distributed-init-method, or raise --distributed-timeout (the store holds check-in values not "
        f"signed with this node's secret: give every node the same {SECRET_ENV})"]


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


def test_under_torchrun_a_store_other_machines_can_reach_needs_a_secret(tmp_path):
    """In a network namespace of its own (no route anywhere), so that nothing is sent even if it tried."""
    if subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot make a network namespace (unshare --net) here")
    args = ["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--max-epoch", "1", "--save-dir", str(tmp_path / "c")]
    env = {**{k: v for k, v in subprocess_env().items() if k != SECRET_ENV}, **torchrun_env(0, 2, "203.0.113.5:29500")}
    result = subprocess.run(["unshare", "--net", *train_command(*args)], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("hetfair-train: error: the rendezvous at 203.0.113.5:29500 can be reached from other "
                           f"machines: give every node's command the same secret in the {SECRET_ENV}"), line


def test_a_check_in_that_a_stalled_store_call_ends_still_points_at_the_secret():
    """The launcher's deadline around the check-in (for a store call that never returns) ends with what the
    check-in had seen: here rank 0's world size, signed with another secret."""
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    server.set("hetfair/world_size", Signer(b"the job's secret").sign("hetfair/world_size", "2|0123456789abcdef"))
    client = dist.TCPStore("127.0.0.1", server.port, None, False, timeout=timedelta(seconds=10))
    guess = CheckIn(client, 1, 2, 1.0, b"a guess")
    assert guess.stalled() == ("rank 1 did not finish the check-in within 1s: a call to the store did not return; "
                               "check --distributed-init-method")
    with pytest.raises(DistributedError, match="rank 0 did not check in"):
        guess.wait()
    assert guess.stalled().endswith(f"(the store holds check-in values not signed with this node's secret: give "
                                    f"every node the same {SECRET_ENV})")

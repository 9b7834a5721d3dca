"""The network-namespace fixture itself: hosts that reach each other, shaped links, nothing left behind."""

from __future__ import annotations

import socket
import subprocess
import sys
from multiprocessing import forkserver
from pathlib import Path

import pytest

import forked_cli
from netns import NETNS_ETC, Network, unavailable

_ECHO_SERVER = """
import socket, sys
server = socket.create_server((sys.argv[1], 5000))
print("ready", flush=True)
connection, _ = server.accept()
connection.sendall(connection.recv(100))
"""
_ECHO_CLIENT = """
import socket, sys
with socket.create_connection((sys.argv[1], 5000), timeout=10) as sock:
    sock.sendall(b"hello")
    print(sock.recv(100).decode())
"""


def _names() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def test_hosts_reach_each_other_over_the_bridge_and_nothing_is_left(make_network):
    network = make_network(2, etc={"hosts": "127.0.0.1 localhost\n10.231.0.1 first\n"})
    first, second = network.hosts
    server = subprocess.Popen(first.command(sys.executable, "-c", _ECHO_SERVER, first.address),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline() == "ready\n"
        reply = subprocess.run(second.command(sys.executable, "-c", _ECHO_CLIENT, first.address),
                               capture_output=True, text=True, timeout=30)
    finally:
        server.kill()
        server.wait()
    assert reply.stdout == "hello\n", reply.stderr
    looked_up = subprocess.run(first.command("getent", "hosts", "first"), capture_output=True, text=True)
    assert looked_up.stdout.split() == ["10.231.0.1", "first"]  # the host's own /etc/hosts
    network.remove()
    assert not any(name in _names() for name in (network.switch, first.namespace, second.namespace))
    assert not (NETNS_ETC / first.namespace).exists()


def test_a_shaped_link_has_a_token_bucket_both_ways(make_network):
    network = make_network(1)
    network.shape(0, "10mbit")
    host = network.hosts[0]
    for namespace, device in ((host.namespace, host.interface), (network.switch, "port0")):
        shown = subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "show", "dev", device],
                               capture_output=True, text=True, check=True).stdout
        assert "tbf" in shown and "rate 10Mbit" in shown, shown


def test_a_failed_creation_removes_what_it_made():
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    network = Network(2)
    network.hosts[1] = network.hosts[0]  # the second host's namespace already exists: creating it fails
    with pytest.raises(RuntimeError, match="netns add"):
        network.create()
    assert not any(name in _names() for name in (network.switch, network.hosts[0].namespace))


def test_without_root_the_reason_is_one_line(monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert unavailable.__wrapped__() == "network namespaces need root"


def _view(seen) -> None:
    """What this process sees of the machine: its interfaces, its /etc/hosts, its hostname's address."""
    seen.put((sorted(name for _, name in socket.if_nameindex()), Path("/etc/hosts").read_text(),
              socket.gethostbyname(socket.gethostname())))


def _command_and_worker(namespace: str, server: str, seen) -> None:
    """A command forked onto a host, as forked_cli starts one, and a worker it starts as the launcher would."""
    forked_cli.become_command(namespace, server)
    _view(seen)
    worker = forked_cli._CONTEXT.Process(target=_view, args=(seen,))
    worker.start()
    worker.join()


def test_a_command_forked_onto_a_host_and_its_workers_see_only_that_host(make_network):
    """forked_cli's commands on a host of a test network, and the workers their launchers start from the tests'
    fork server, see what ``ip netns exec`` shows a command: the host's interfaces and /etc files, not the
    machine's, whose own stay as they were."""
    hosts_file = f"127.0.0.1 localhost\n127.0.0.1 {socket.gethostname()}\n"
    host = make_network(1, etc={"hosts": hosts_file}).hosts[0]
    machine = Path("/etc/hosts").read_text()
    forkserver._forkserver.ensure_running()
    seen = forked_cli._CONTEXT.SimpleQueue()
    command = forked_cli._CONTEXT.Process(target=_command_and_worker, args=(
        host.namespace, forkserver._forkserver._forkserver_address, seen))
    command.start()
    command.join(60)
    assert command.exitcode == 0
    assert [seen.get(), seen.get()] == [(["eth0", "lo"], hosts_file, "127.0.0.1")] * 2
    assert Path("/etc/hosts").read_text() == machine

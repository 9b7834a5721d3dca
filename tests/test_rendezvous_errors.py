"""A tcp:// rendezvous that cannot work is one error line, soon: a host that does not resolve, a port where
another program listens. torch's C++ retries and stack frames stay off the terminal.

The listeners are on 127.0.0.1; the host name is resolved inside a network namespace without a
name server, so no query leaves the machine.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import pytest

from helpers import TOY_PLUGIN, rank_flags, subprocess_env, train_command
from hetfair.launch.native_output import CPP_LOG_LEVEL_ENV, native_stderr_discarded
from hetfair.launch.rendezvous import SECRET_ENV

_SLOW_START_SECONDS = 30  # interpreter and torch start-up on a loaded machine


def quiet_env() -> dict[str, str]:
    """The tests' environment without a C++ log level of the user's (which would keep torch's lines)."""
    return {name: value for name, value in subprocess_env().items() if name != CPP_LOG_LEVEL_ENV}


def rank1_command(init: str, timeout: float, tmp_path) -> list[str]:
    return train_command("--user-dir", str(TOY_PLUGIN), "--task", "toy", "--max-epoch", "1",
                         "--save-dir", str(tmp_path / "c"), "--log-format", "none", *rank_flags(1, 2, init),
                         "--distributed-timeout", str(timeout))


def test_a_host_that_does_not_resolve_fails_at_once_naming_it(make_network, tmp_path):
    host = make_network(1, etc={"hosts": "127.0.0.1 localhost\n", "resolv.conf": ""}).hosts[0]
    began = time.monotonic()
    result = subprocess.run(host.command(*rank1_command("tcp://node-a.invalid:29500", 600, tmp_path)),
                            cwd=tmp_path, env={**quiet_env(), SECRET_ENV: "the job's secret"},
                            capture_output=True, text=True, timeout=60)
    assert time.monotonic() - began < _SLOW_START_SECONDS  # not the 600 s --distributed-timeout
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line.startswith("hetfair-train: error: cannot resolve the rendezvous host node-a.invalid ("), line


def _serve(server: socket.socket, behaviour: str, held: list[socket.socket]) -> None:
    while True:
        try:
            connection, _ = server.accept()
        except OSError:  # closed: the test is over
            return
        if behaviour == "closes":
            connection.close()
            continue
        connection.sendall(b"SSH-2.0-OpenSSH_9.2\r\n" * 8)  # answers garbage
        held.append(connection)


@contextmanager
def foreign_listener(behaviour: str) -> Iterator[int]:
    """A port on 127.0.0.1 where a program that is not a store accepts connections; yields the port."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    thread = threading.Thread(target=_serve, args=(server, behaviour, held), daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        server.shutdown(socket.SHUT_RDWR)
        server.close()
        thread.join(timeout=5)
        for connection in held:
            connection.close()


# a listener that never answers: test_signals_and_hangs.py
@pytest.mark.parametrize("behaviour", ["closes", "answers garbage"])
def test_a_port_where_another_program_listens_is_one_line(tmp_path, behaviour):
    timeout = 2
    with foreign_listener(behaviour) as port:
        began = time.monotonic()
        result = subprocess.run(rank1_command(f"tcp://127.0.0.1:{port}", timeout, tmp_path), cwd=tmp_path,
                                env=quiet_env(), capture_output=True, text=True, timeout=120)
        elapsed = time.monotonic() - began
    assert result.returncode == 2
    [line] = result.stderr.splitlines()  # no C++ retries, no stack frames
    assert line.startswith("hetfair-train: error: [rank 1] rank 1 ") and line.endswith(
        "check that it is rank 0's address and that no other program listens there"), line
    assert elapsed < timeout + 5 + _SLOW_START_SECONDS  # the timeout, the rendezvous's grace and start-up


def test_only_native_writes_to_stderr_are_discarded(capfd):
    with native_stderr_discarded():
        os.write(2, b"[W socket.cpp:207] from C++\n")
        print("hetfair-train: warning: from Python", file=sys.stderr)
    os.write(2, b"after the rendezvous\n")
    assert capfd.readouterr().err == "hetfair-train: warning: from Python\nafter the rendezvous\n"

"""Several "hosts" on one machine: network namespaces joined by veth pairs to a bridge.

Each host is a namespace with ``lo`` up and an ``eth0`` holding ``10.231.0.(i+1)/24``; the
bridge lives in a namespace of its own, so nothing is added to the machine's own network
and traffic stays between the namespaces made here. A link may be shaped with ``tc tbf``
(both directions), and the hosts may get their own files in ``/etc`` (``ip netns exec`` binds
``/etc/netns/NAME/FILE`` over ``/etc/FILE``: ``hosts``, ``resolv.conf``). Names are unique
per run; :meth:`Network.remove`
deletes everything, also after a failure. Needs root and iproute2; otherwise
:func:`unavailable` says why in one line. Plain Python (no pytest): the tests' ``make_network``
fixture and ``benchmarks/bench_links.py`` (with ``tests/`` on ``sys.path``) both use it.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

SUBNET = "10.231.0"
"""The private test range: its addresses exist only inside the namespaces made here."""
NETNS_ETC = Path("/etc/netns")


@dataclass(frozen=True)
class Host:
    """One namespace: its name, its interface towards the bridge and that interface's address."""

    namespace: str
    address: str
    interface: str = "eth0"

    def command(self, *args: str) -> list[str]:
        """``args`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *args]


@functools.cache
def unavailable() -> Optional[str]:
    """Why namespaces cannot be made here (one line), or ``None`` when they can."""
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's ip command, which is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"hetfair-probe-{secrets.token_hex(4)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class Network:
    """``count`` hosts on one bridge, each with the files ``etc`` (name: text) over its ``/etc``.

    Use as a context manager, or call :meth:`create` and :meth:`remove`.
    """

    def __init__(self, count: int, etc: Optional[Mapping[str, str]] = None) -> None:
        token = secrets.token_hex(4)
        self.switch = f"hetfair-{token}-switch"
        self.hosts = [Host(f"hetfair-{token}-h{i}", f"{SUBNET}.{i + 1}") for i in range(count)]
        self.etc = dict(etc or {})
        self._made: list[str] = []

    def __enter__(self) -> "Network":
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def create(self) -> None:
        """Make the bridge and every host; on a failure, remove what was made and raise."""
        try:
            self._add_namespace(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for index, host in enumerate(self.hosts):
                self._add_host(index, host)
        except BaseException:
            self.remove()
            raise

    def shape(self, index: int, rate: str, burst: str = "32kbit", latency: str = "50ms") -> None:
        """Limit host ``index``'s link to ``rate`` (a tc rate such as ``10mbit``) in both directions."""
        host = self.hosts[index]
        for namespace, device in ((host.namespace, host.interface), (self.switch, _port(index))):
            _ip("netns", "exec", namespace, "tc", "qdisc", "replace", "dev", device, "root", "tbf",
                "rate", rate, "burst", burst, "latency", latency)

    def remove(self) -> None:
        """Delete every namespace made (their veth pairs go with them) and their /etc/netns files."""
        for namespace in reversed(self._made):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
            shutil.rmtree(NETNS_ETC / namespace, ignore_errors=True)
        self._made.clear()
        try:
            NETNS_ETC.rmdir()  # only if no other run uses it
        except OSError:
            pass

    def _add_namespace(self, namespace: str) -> None:
        _ip("netns", "add", namespace)
        self._made.append(namespace)
        _ip("-n", namespace, "link", "set", "lo", "up")

    def _add_host(self, index: int, host: Host) -> None:
        if self.etc:
            (NETNS_ETC / host.namespace).mkdir(parents=True)
            for name, text in self.etc.items():
                (NETNS_ETC / host.namespace / name).write_text(text)
        self._add_namespace(host.namespace)
        port = _port(index)
        _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", host.interface,
            "netns", host.namespace)
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
        _ip("-n", host.namespace, "link", "set", host.interface, "up")


def _port(index: int) -> str:
    return f"port{index}"


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")

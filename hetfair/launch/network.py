"""The way from this node to the rendezvous host: that host's address and the interface that reaches it.

gloo binds to the address of this machine's hostname unless ``GLOO_SOCKET_IFNAME`` names an
interface, and many machines map their hostname to 127.0.0.1 in ``/etc/hosts``: each rank
then tells the others to connect to 127.0.0.1 and the job fails ("Gloo connectFullMesh
failed ... remote=[127.0.0.1]"). So the ranks of a job that meets at a tcp address use the
interface this machine sends from towards that address (on rank 0's node: the interface
holding the address itself). ``--distributed-interface`` names another; a
``GLOO_SOCKET_IFNAME`` or ``NCCL_SOCKET_IFNAME`` the user set is kept unless the flag is
given.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import sys
from typing import Optional, Union

import torch

from hetfair.launch.rendezvous import StoreAddress, loopback_interface
from hetfair.errors import ConfigError, DistributedError

IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]
GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"
NCCL_INTERFACE_ENV = "NCCL_SOCKET_IFNAME"
_SOCKADDR_STARTS_WITH_LENGTH = sys.platform == "darwin" or "bsd" in sys.platform  # BSD: sa_len, then sa_family


def resolve_host(address: StoreAddress) -> str:
    """The first address the rendezvous host resolves to; one error line naming the host if it does not."""
    try:
        infos = socket.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise DistributedError(
            f"cannot resolve the rendezvous host {address.host} ({exc.strerror}); check the host name or give its "
            f"IP address"
        ) from None
    return infos[0][4][0]


def choose_interface(given: Optional[str], address: Optional[StoreAddress]) -> Optional[str]:
    """The interface the ranks of this node use: ``given``, else the one towards a tcp rendezvous.

    ``address`` None is a private store on this machine (the loopback interface). A tcp
    host is resolved first, so a wrong name fails at once. ``None``: leave gloo's default
    (a ``file://`` store on a shared file system names no host).
    """
    host_address = resolve_host(address) if address is not None and address.scheme == "tcp" else None
    if given is not None:
        return check_interface(given)
    if address is None:
        return loopback_interface()
    if host_address is None:
        return None
    return interface_towards(host_address, address.host)


def check_interface(name: str) -> str:
    """``name`` if this machine has such a network interface, else one error line listing those it has."""
    names = [known for _, known in socket.if_nameindex()]
    if name not in names:
        raise ConfigError(
            f"--distributed-interface {name}: this machine has no network interface of that name; it has "
            f"{', '.join(names)}"
        )
    return name


def interface_towards(address: str, host: str) -> Optional[str]:
    """The interface holding the address this machine sends from to ``address`` (``host``'s), if one does."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((address, 9))  # a UDP connect sends nothing: it only chooses the route
        except OSError as exc:
            raise DistributedError(
                f"no route from this machine to the rendezvous host {host} ({address}): {exc.strerror}"
            ) from None
        local = ipaddress.ip_address(probe.getsockname()[0].split("%")[0])
    return next((name for name, held in interface_addresses() if held == local), None)


def use_interface(interface: Optional[str], device: torch.device, override: bool) -> None:
    """Make gloo, and NCCL on a GPU, use ``interface`` (in this process); a user's own setting stays unless
    ``override``."""
    if interface is None:
        return
    names = [GLOO_INTERFACE_ENV] + ([NCCL_INTERFACE_ENV] if device.type == "cuda" else [])
    for name in names:
        if override or name not in os.environ:
            os.environ[name] = interface


class _IfAddrs(ctypes.Structure):
    """The leading fields of getifaddrs(3)'s ``struct ifaddrs`` (only read through its pointers)."""


_IfAddrs._fields_ = [("next", ctypes.POINTER(_IfAddrs)), ("name", ctypes.c_char_p), ("flags", ctypes.c_uint),
                     ("addr", ctypes.c_void_p)]


def interface_addresses() -> list[tuple[str, IPAddress]]:
    """Every (interface name, IP address) of this machine, as getifaddrs(3) lists them (gloo reads the same)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        getifaddrs, freeifaddrs = libc.getifaddrs, libc.freeifaddrs
    except (OSError, AttributeError):  # no getifaddrs (Windows)
        return []
    head = ctypes.POINTER(_IfAddrs)()
    if getifaddrs(ctypes.byref(head)) != 0:
        return []
    try:
        found = []
        node = head
        while node:
            entry = node.contents
            parsed = _ip_address(entry.addr) if entry.addr else None
            if parsed is not None:
                found.append((entry.name.decode(), parsed))
            node = entry.next
        return found
    finally:
        freeifaddrs(head)


def _ip_address(sockaddr: int) -> Optional[IPAddress]:
    head = ctypes.string_at(sockaddr, 2)
    family = head[1] if _SOCKADDR_STARTS_WITH_LENGTH else int.from_bytes(head, sys.byteorder)
    if family == socket.AF_INET:  # sockaddr_in: family, port, then the address
        return ipaddress.IPv4Address(ctypes.string_at(sockaddr, 8)[4:8])
    if family == socket.AF_INET6:  # sockaddr_in6: family, port, flow info, then the address
        return ipaddress.IPv6Address(ctypes.string_at(sockaddr, 24)[8:24])
    return None

"""The cluster file: which devices each node has and how fast the links between them are.

A TOML file (or the same structure in YAML, ``.yaml`` / ``.yml``)::

    [network]                  # between nodes; required when there is more than one node
    bandwidth = "10Gbit/s"
    latency = "50us"           # optional, default 50us

    [[node]]
    name = "lab-3090"          # optional, default node1, node2, ... (its place in the file)
    devices = [{kind = "RTX3090", count = 4}]
    link = {bandwidth = "12GB/s", latency = "10us"}   # optional: between this node's devices

    [[node]]
    name = "borrowed-a100"
    devices = [{kind = "A100-80GB", count = 2}]
    uplink = {bandwidth = "1Gbit/s"}   # optional: this node's own, slower network link

    [[node]]
    name = "old-box"
    devices = [{kind = "measured", memory = "11G", fp32 = "11T", fp16 = "22T", memory_bandwidth = "484GB/s"}]

A device is a catalogue ``kind`` (:mod:`hetfair.cluster.catalogue`), whose numbers it may override
(``{kind = "RTX3090", fp32 = "30T"}``: then ``measured``), or ``kind = "measured"`` with at least
``memory`` and ``fp32``; ``count`` (default 1) repeats it. Units: memory in bytes or ``K``, ``M``,
``G``, ``T`` (powers of 1024, as ``--memory-budget``); FLOP/s, bandwidths and latencies in powers of
1000 (``35.6T``, ``10Gbit/s`` = 1.25e9 bytes/s, ``12GB/s``, ``50us``); a plain number is bytes, FLOP/s,
bytes/s or seconds. Every mistake is one :class:`~hetfair.errors.ConfigError` line naming the file and
the place (``node 2 ("old-box") device 1``: nodes and devices count from 1 there, as in the file; the
API's node indices count from 0). docs/cluster-file.md has the whole format.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from hetfair.cluster.catalogue import device_kind
from hetfair.errors import ConfigError, first_line
from hetfair.memory.sizes import parse_size


@dataclass(frozen=True)
class Device:
    """One device: memory in bytes, FLOP/s by precision (``fp32`` always), memory bandwidth in bytes/s."""

    kind: str  # catalogue name, "measured", or "cpu" (a measured CPU: its processes meet over gloo)
    memory: int
    flops: Mapping[str, float]
    memory_bandwidth: Optional[float]  # None: unknown
    measured: bool  # some numbers measured (given in the file) rather than from the catalogue
    step_overhead: float = 0.0
    """Seconds a training step costs beyond its FLOPs (the framework, kernel launches), measured; 0: not known."""


@dataclass(frozen=True)
class Link:
    """A link's bandwidth in bytes per second (> 0) and latency in seconds (>= 0)."""

    bandwidth: float
    latency: float


# Between one node's GPUs without NVLink: what an all-reduce over PCIe gets in practice (PCIe 3.0 x16's
# effective rate; PCIe 4.0 cards without peer-to-peer access go through the host and land near it).
DEFAULT_INTRA_NODE = Link(12e9, 10e-6)
# A one-node cluster's network (never crossed) and the latency of a network given without one: 10 GbE.
DEFAULT_NETWORK = Link(10e9 / 8, 50e-6)


@dataclass(frozen=True)
class Node:
    """A machine: its devices (at least one), the link between them, its own network link if slower."""

    name: str
    devices: tuple[Device, ...]
    link: Link = DEFAULT_INTRA_NODE
    uplink: Optional[Link] = None  # None: the cluster's network


@dataclass(frozen=True)
class Cluster:
    """The nodes (at least one) and the network between them; node indices count from 0."""

    nodes: tuple[Node, ...]
    network: Link

    @property
    def devices(self) -> list[tuple[int, Device]]:
        """Every device with its node's index, in order."""
        return [(index, device) for index, node in enumerate(self.nodes) for device in node.devices]

    @property
    def world_size(self) -> int:
        return sum(len(node.devices) for node in self.nodes)

    def node_uplink(self, index: int) -> Link:
        """Node ``index``'s link to the network: its uplink, else the network."""
        return self.nodes[index].uplink or self.network

    def slowest_network_link(self) -> Link:
        """The least bandwidth and the most latency of the network and every uplink: a ring over the
        nodes runs at its slowest hop."""
        links = [self.network, *(self.node_uplink(index) for index in range(len(self.nodes)))]
        return Link(min(link.bandwidth for link in links), max(link.latency for link in links))


_NUMBER = r"([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)"
_DECIMAL = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BANDWIDTH = re.compile(rf"^\s*{_NUMBER}\s*(?:([kKMGT]?)(bit|B)/s)?\s*$")
_LATENCY = re.compile(rf"^\s*{_NUMBER}\s*(s|ms|us|µs|ns)?\s*$")
_PER_SECOND = {None: 1.0, "s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}  # dividing: 50/1e6 == 50e-6
_FLOPS = re.compile(rf"^\s*{_NUMBER}\s*([kKMGTP]?)\s*(?:FLOP/s|FLOPS)?\s*$", re.IGNORECASE)


def _parse(value: str | float, pattern: re.Pattern[str], convert: Callable[[float, re.Match[str]], float],
           what: str, example: str) -> float:
    """A number as is, or a string's number ``convert``-ed by its unit (``pattern``); finite, else ValueError."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str) and (match := pattern.match(value)):
        number = convert(float(match[1]), match)
    else:
        raise ValueError(f"'{value}' is not a {what} (write it like {example})")
    if not math.isfinite(number):
        raise ValueError(f"'{value}' is not a finite {what}")
    return number


def _positive(number: float, value: str | float, what: str) -> float:
    if number <= 0:
        raise ValueError(f"a {what} must be more than 0, not '{value}'")
    return number


def _bytes_per_second(number: float, match: re.Match[str]) -> float:
    return number * _DECIMAL[(match[2] or "").upper()] / (8 if match[3] == "bit" else 1)


def parse_bandwidth(value: str | float) -> float:
    """Bytes/s from a number (bytes/s) or ``"10Gbit/s"``, ``"100Mbit/s"``, ``"12GB/s"`` (k, M, G, T: powers of 1000)."""
    number = _parse(value, _BANDWIDTH, _bytes_per_second, "bandwidth", "10Gbit/s, 100Mbit/s or 12GB/s")
    return _positive(number, value, "bandwidth")


def parse_latency(value: str | float) -> float:
    """Seconds from a number (seconds) or ``"50us"``, ``"50µs"``, ``"0.2ms"``, ``"2s"``."""
    number = _parse(value, _LATENCY, lambda x, m: x / _PER_SECOND[m[2]], "latency", "50us, 0.2ms or 2s")
    if number < 0:
        raise ValueError(f"a latency must not be negative, not '{value}'")
    return number


def parse_flops(value: str | float) -> float:
    """FLOP/s from a number or ``"35.6T"``, ``"35.6 TFLOP/s"``, ``"312e12"``, ``"50G"`` (powers of 1000)."""
    number = _parse(value, _FLOPS, lambda x, m: x * _DECIMAL[m[2].upper()], "FLOP/s rate",
                    "35.6T, 35.6 TFLOP/s or 50G")
    return _positive(number, value, "FLOP/s rate")


def parse_memory(value: str | int) -> int:
    """Bytes from a number (bytes) or ``"24G"``, ``"512M"``, ``"1.5GiB"`` (K, M, G, T: powers of 1024)."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"'{value}' is not a memory size (write it like 24G, 512M or 1.5GiB)")
    return parse_size(value if isinstance(value, str) else str(value))


def load_cluster(path: str | Path) -> Cluster:
    """The cluster a ``.toml``, ``.yaml`` or ``.yml`` file describes; a bad file is one ConfigError line."""
    path = Path(path)
    reader = _READERS.get(path.suffix.lower())
    if reader is None:
        raise ConfigError(f"{path}: a cluster file ends in .toml, .yaml or .yml, not '{path.suffix}'")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such cluster file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the cluster file: {first_line(exc)}") from None
    return cluster_from_dict(reader(text, path), str(path))


def _read_toml(text: str, path: Path) -> Any:
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {first_line(exc)}") from None


def _read_yaml(text: str, path: Path) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None) or first_line(exc)
        where = f" (at line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"{path}: not valid YAML: {problem}{where}") from None


_READERS: dict[str, Callable[[str, Path], Any]] = {".toml": _read_toml, ".yaml": _read_yaml, ".yml": _read_yaml}

_TOP_KEYS = ("network", "node")
_NODE_KEYS = ("name", "devices", "link", "uplink")
_LINK_KEYS = ("bandwidth", "latency")
_PRECISIONS = ("fp32", "fp16", "bf16")
_NUMBERS: dict[str, Callable[[Any], float]] = {
    "memory": parse_memory, "fp32": parse_flops, "fp16": parse_flops, "bf16": parse_flops,
    "memory_bandwidth": parse_bandwidth, "step_overhead": parse_latency}
_MEASURED_KINDS = ("measured", "cpu")
_DEVICE_KEYS = ("kind", "count", *_NUMBERS)
_MEASURED_EXAMPLE = '{kind = "measured", memory = "24G", fp32 = "35T"}'


def cluster_from_dict(data: Mapping[str, Any], where: str) -> Cluster:
    """The cluster the file ``where`` holds, as TOML or YAML read it; a mistake is one ConfigError line."""
    _check_table(data, _TOP_KEYS, where, "the file")
    entries = _node_entries(data.get("node"), where)
    if "network" not in data and len(entries) > 1:
        raise ConfigError(f"{where}: network is missing: a cluster of {len(entries)} nodes needs a [network] table, "
                          f'e.g. bandwidth = "10Gbit/s" and latency = "50us"')
    network = _link(data.get("network", {}), f"{where}: network", DEFAULT_NETWORK, "network" in data)
    nodes = tuple(_node(entry, index, network, where) for index, entry in enumerate(entries, 1))
    _check_unique_names(nodes, where)
    return Cluster(nodes, network)


def _describe(value: Any) -> str:
    if value is None or value == []:
        return "nothing" if value is None else "an empty list"
    return {dict: "a table", list: "a list", str: "a string"}.get(type(value), repr(value))


def _check_table(value: Any, allowed: Sequence[str], at: str, what: str = "it") -> None:
    """``value`` is a table with no key but ``allowed``."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{at}: {what} must be a table of {', '.join(allowed)}, not {_describe(value)}")
    unknown = sorted(str(key) for key in value if key not in allowed)
    if unknown:
        raise ConfigError(f"{at}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
                          f"(the keys are {', '.join(allowed)})")


def _node_entries(value: Any, where: str) -> list[Any]:
    if value is None or value == []:
        raise ConfigError(f"{where}: no nodes: add a [[node]] table (in YAML, a node: list) with devices")
    if not isinstance(value, list):
        raise ConfigError(f"{where}: node must be a list of tables: write [[node]], not [node] "
                          f"(in YAML, node: with a - item per node)")
    return value


def _get(table: Mapping[str, Any], key: str, parse: Callable[[Any], Any], at: str, default: Any = None) -> Any:
    """``table[key]`` as ``parse`` reads it, or ``default`` when absent."""
    if key not in table:
        return default
    try:
        return parse(table[key])
    except ValueError as exc:
        raise ConfigError(f"{at}: {key}: {exc}") from None


def _link(value: Any, at: str, default: Link, bandwidth_required: bool) -> Link:
    """The link table ``value``; absent keys from ``default``."""
    _check_table(value, _LINK_KEYS, at)
    if bandwidth_required and "bandwidth" not in value:
        raise ConfigError(f'{at}: bandwidth is missing: give it, e.g. bandwidth = "10Gbit/s"')
    return Link(_get(value, "bandwidth", parse_bandwidth, at, default.bandwidth),
                _get(value, "latency", parse_latency, at, default.latency))


def _node(entry: Any, index: int, network: Link, where: str) -> Node:
    at = f"{where}: node {index}"
    _check_table(entry, _NODE_KEYS, at)
    name = entry.get("name", f"node{index}")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{at}: name must be a non-empty string, not {_describe(name)}")
    at = f'{at} ("{name}")'
    link = _link(entry.get("link", {}), f"{at} link", DEFAULT_INTRA_NODE, False)
    uplink = _link(entry["uplink"], f"{at} uplink", network, True) if "uplink" in entry else None
    return Node(name, _devices(entry.get("devices"), at), link, uplink)


def _devices(value: Any, at: str) -> tuple[Device, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{at}: devices must be a non-empty list of tables, not {_describe(value)}: "
                          f'e.g. devices = [{{kind = "RTX3090", count = 4}}]')
    return tuple(device for number, entry in enumerate(value, 1)
                 for device in _device_entry(entry, f"{at} device {number}"))


def _device_entry(entry: Any, at: str) -> list[Device]:
    """The ``count`` devices one entry of ``devices`` stands for."""
    _check_table(entry, _DEVICE_KEYS, at)
    kind, count = entry.get("kind"), entry.get("count", 1)
    if not isinstance(kind, str):
        raise ConfigError(f'{at}: kind must be a catalogue name (e.g. kind = "RTX3090") or "measured" with '
                          f"memory and fp32, not {_describe(kind)}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(f"{at}: count must be a whole number of at least 1, not {_describe(count)}")
    given = {key: _get(entry, key, parse, at) for key, parse in _NUMBERS.items() if key in entry}
    device = _measured(kind.lower(), given, at) if kind.lower() in _MEASURED_KINDS else _catalogued(kind, given, at)
    return [device] * count


def _measured(kind: str, given: Mapping[str, Any], at: str) -> Device:
    missing = [key for key in ("memory", "fp32") if key not in given]
    if missing:
        raise ConfigError(f"{at}: a {kind} device needs {' and '.join(missing)}, e.g. {_MEASURED_EXAMPLE}")
    flops = {precision: given[precision] for precision in _PRECISIONS if precision in given}
    return Device(kind, given["memory"], flops, given.get("memory_bandwidth"), measured=True,
                  step_overhead=given.get("step_overhead", 0.0))


def _catalogued(kind: str, given: Mapping[str, Any], at: str) -> Device:
    """The catalogue's device ``kind``, with the numbers ``given`` in place of its own."""
    try:
        known = device_kind(kind)
    except ConfigError as exc:
        raise ConfigError(f"{at}: {exc}") from None
    flops = {**known.flops, **{precision: given[precision] for precision in _PRECISIONS if precision in given}}
    return Device(known.name, given.get("memory", known.memory), flops,
                  given.get("memory_bandwidth", known.memory_bandwidth), measured=bool(set(given) & set(_PRECISIONS)),
                  step_overhead=given.get("step_overhead", 0.0))


def _check_unique_names(nodes: Sequence[Node], where: str) -> None:
    first: dict[str, int] = {}
    for index, node in enumerate(nodes, 1):
        if node.name in first:
            raise ConfigError(f'{where}: node {index} ("{node.name}"): node {first[node.name]} has that name too; '
                              f"give every node its own name")
        first[node.name] = index

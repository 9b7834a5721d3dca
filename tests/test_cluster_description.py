"""The cluster file (hetfair/cluster/description.py) and the GPU catalogue (hetfair/cluster/catalogue.py)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from hetfair.cluster import (CATALOGUE, DEFAULT_INTRA_NODE, DEFAULT_NETWORK, Cluster, Device, Link, Node,
                             device_kind, load_cluster, parse_bandwidth, parse_flops, parse_latency, parse_memory)
from hetfair.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = REPO_ROOT / "examples" / "clusters"
GiB = 1 << 30


def catalogue_table() -> str:
    """The catalogue as docs/cluster-file.md shows it (this function wrote that table)."""
    def tflops(kind, precision):
        return f"{kind.flops[precision] / 1e12:g}" if precision in kind.flops else "-"

    rows = ["| name | memory | fp32 TFLOP/s | fp16 TFLOP/s | bf16 TFLOP/s | memory bandwidth | source |",
            "|---|---|---|---|---|---|---|"]
    rows += [f"| {k.name} | {k.memory / GiB:g} GiB | {tflops(k, 'fp32')} | {tflops(k, 'fp16')} | {tflops(k, 'bf16')} "
             f"| {k.memory_bandwidth / 1e9:g} GB/s | {k.source} |" for k in CATALOGUE.values()]
    return "\n".join(rows) + "\n"


def write(tmp_path: Path, text: str, name: str = "cluster.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_lab_example_parses_to_the_hand_computed_numbers():
    cluster = load_cluster(EXAMPLES / "lab.toml")
    assert cluster.network == Link(bandwidth=1.25e9, latency=50e-6)  # 10Gbit/s, 50us
    assert [node.name for node in cluster.nodes] == ["lab-3090", "lab-v100", "lab-a100"]
    assert [len(node.devices) for node in cluster.nodes] == [4, 2, 2]
    assert cluster.world_size == 8
    assert cluster.nodes[0].devices[0] == Device("RTX3090", 24 * GiB, {"fp32": 35.6e12, "fp16": 71e12, "bf16": 71e12},
                                                 936e9, measured=False)
    assert cluster.nodes[1].devices[1] == Device("V100-16GB", 16 * GiB, {"fp32": 15.7e12, "fp16": 125e12}, 900e9, False)
    assert cluster.nodes[2].devices[0] == Device("A100-80GB", 80 * GiB, {"fp32": 19.5e12, "fp16": 312e12,
                                                                         "bf16": 312e12}, 2039e9, False)
    assert all(node.link == DEFAULT_INTRA_NODE and node.uplink is None for node in cluster.nodes)
    assert [index for index, _ in cluster.devices] == [0, 0, 0, 0, 1, 1, 2, 2]


def test_yaml_and_toml_of_the_same_cluster_are_equal():
    assert load_cluster(EXAMPLES / "lab.yaml") == load_cluster(EXAMPLES / "lab.toml")


def test_the_cpu_test_bed_has_two_measured_nodes_on_100_mbit():
    cluster = load_cluster(EXAMPLES / "two_cpu_nodes.toml")
    cpu = Device("measured", 8 * GiB, {"fp32": 50e9}, None, measured=True)
    assert [node.devices for node in cluster.nodes] == [(cpu,), (cpu,)]
    assert cluster.network == Link(12.5e6, 100e-6)


def test_the_documented_example_with_link_uplink_and_measured_devices(tmp_path):
    cluster = load_cluster(write(tmp_path, """
[network]
bandwidth = "10Gbit/s"
latency = "50us"

[[node]]
name = "lab-3090"
devices = [{kind = "RTX3090", count = 4}]
link = {bandwidth = "12GB/s", latency = "10us"}

[[node]]
name = "borrowed-a100"
devices = [{kind = "a100 80gb", count = 2}]
uplink = {bandwidth = "1Gbit/s"}

[[node]]
devices = [{kind = "measured", memory = "11G", fp32 = "11T", fp16 = "22T", memory_bandwidth = "484GB/s"},
           {kind = "RTX3090", fp32 = "30T"}]
"""))
    first, borrowed, old = cluster.nodes
    assert first.link == Link(12e9, 10e-6)
    assert borrowed.uplink == Link(125e6, 50e-6)  # the latency is the network's
    assert old.name == "node3"
    assert old.devices[0] == Device("measured", 11 * GiB, {"fp32": 11e12, "fp16": 22e12}, 484e9, measured=True)
    assert old.devices[1] == Device("RTX3090", 24 * GiB, {"fp32": 30e12, "fp16": 71e12, "bf16": 71e12}, 936e9, True)
    assert cluster.node_uplink(1) == Link(125e6, 50e-6) and cluster.node_uplink(0) == cluster.network


def test_slowest_network_link_picks_the_slowest_uplink_and_the_largest_latency():
    device = Device("measured", GiB, {"fp32": 1e9}, None, True)
    cluster = Cluster((Node("a", (device,), uplink=Link(1e8, 1e-5)), Node("b", (device,), uplink=Link(5e7, 1e-6)),
                       Node("c", (device,))), network=Link(1e9, 2e-5))
    assert cluster.slowest_network_link() == Link(5e7, 2e-5)


def test_one_node_needs_no_network(tmp_path):
    cluster = load_cluster(write(tmp_path, '[[node]]\nname = "solo"\ndevices = [{kind = "T4"}]\n'))
    assert cluster.network == DEFAULT_NETWORK and cluster.world_size == 1


@pytest.mark.parametrize("text, match", [
    ('[[node]]\ndevices = [{kind = "RTX3080"}]', r"node 1 \(\"node1\"\) device 1: unknown device kind 'RTX3080'.*"
                                                 r"RTX3090.*kind = \"measured\""),
    ('[network]\nbandwidth = 0\n[[node]]\ndevices = [{kind = "T4"}]\n[[node]]\ndevices = [{kind = "T4"}]',
     r"network: bandwidth: a bandwidth must be more than 0"),
    ('[network]\nbandwidth = "-1Gbit/s"\n[[node]]\ndevices = [{kind = "T4"}]',
     r"network: bandwidth: a bandwidth must be more than 0, not '-1Gbit/s'"),
    ('[[node]]\nname = "x"\ndevices = [{kind = "T4"}]\nlink = {bandwidth = "1GB/s", latency = "-5us"}',
     r"node 1 \(\"x\"\) link: latency: a latency must not be negative"),
    ('[[node]]\nname = "empty"\ndevices = []',
     r"node 1 \(\"empty\"\): devices must be a non-empty list of tables, not an empty list"),
    ('[[node]]\nname = "x"', r"node 1 \(\"x\"\): devices must be a non-empty list of tables, not nothing"),
    ('[[node]]\nname = ""\ndevices = [{kind = "T4"}]', r"node 1: name must be a non-empty string"),
    ('[[node]]\nnmae = "x"\ndevices = [{kind = "T4"}]', r"node 1: unknown key nmae \(the keys are name, devices, "
                                                         r"link, uplink\)"),
    ('[netwrk]\nbandwidth = "1Gbit/s"\n[[node]]\ndevices = [{kind = "T4"}]', r"unknown key netwrk \(the keys are "
                                                                             r"network, node\)"),
    ('[[node]]\ndevices = [{kind = "T4", cuont = 2}]', r"device 1: unknown key cuont \(the keys are kind, count, "),
    ('[[node]]\ndevices = [{kind = "T4"}]\nuplink = {bandwidth = "1Gbit/s", latncy = "1ms"}',
     r"node1\"\) uplink: unknown key latncy"),
    ('[network]\nbandwidth = "10Gb/s"\n[[node]]\ndevices = [{kind = "T4"}]',
     r"network: bandwidth: '10Gb/s' is not a bandwidth \(write it like 10Gbit/s"),
    ('[[node]]\ndevices = [{kind = "T4"}]\nlink = {latency = "5 minutes"}', r"link: latency: '5 minutes' is not a "
                                                                            r"latency"),
    ('[[node]]\ndevices = [{kind = "measured", memory = "8 gigs", fp32 = "1T"}]',
     r"device 1: memory: '8 gigs' is not a memory size"),
    ('[[node]]\ndevices = [{kind = "measured", memory = "8G", fp32 = "fast"}]', r"fp32: 'fast' is not a FLOP/s rate"),
    ('[[node]]\ndevices = [{kind = "T4", count = 0}]', r"device 1: count must be a whole number of at least 1, "
                                                       r"not 0$"),
    ('[[node]]\ndevices = [{kind = "T4", count = 1.5}]', r"count must be a whole number"),
    ('[[node]]\ndevices = [{kind = "measured", memory = "8G"}]', r"device 1: a measured device needs fp32, e.g. "),
    ('[[node]]\ndevices = [{kind = "measured", fp32 = "8T"}]', r"a measured device needs memory"),
    ('[[node]]\ndevices = [{count = 2}]', r"device 1: kind must be a catalogue name .* not nothing"),
    ('[[node]]\ndevices = [{kind = "T4"}]\n[[node]]\ndevices = [{kind = "T4"}]',
     r"network is missing: a cluster of 2 nodes needs a \[network\] table"),
    ('[network]\nlatency = "1ms"\n[[node]]\ndevices = [{kind = "T4"}]', r"network: bandwidth is missing"),
    ('[[node]]\ndevices = [{kind = "T4"}]\nuplink = {latency = "1ms"}', r"uplink: bandwidth is missing"),
    ('[node]\ndevices = [{kind = "T4"}]', r"node must be a list of tables: write \[\[node\]\], not \[node\]"),
    ('[network]\nbandwidth = "1Gbit/s"', r"no nodes: add a \[\[node\]\] table"),
    ('[network]\nbandwidth = "1Gbit/s"\n[[node]]\nname = "a"\ndevices = [{kind = "T4"}]\n'
     '[[node]]\nname = "a"\ndevices = [{kind = "T4"}]', r"node 2 \(\"a\"\): node 1 has that name too"),
    ('[network\nbandwidth = 1', r"not valid TOML: .*line 1"),
])
def test_a_bad_cluster_file_is_one_config_error_line_naming_the_place(tmp_path, text, match):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=match) as caught:
        load_cluster(path)
    assert str(caught.value).startswith(f"{path}: ") and "\n" not in str(caught.value)


@pytest.mark.parametrize("name, text, match", [
    ("cluster.yaml", "network:\n  bandwidth: 1Gbit/s\n node: [\n", r"not valid YAML: .*\(at line \d+, column \d+\)"),
    ("cluster.yaml", "", r"the file must be a table of network, node, not nothing"),
    ("cluster.yml", "- just\n- a list\n", r"the file must be a table of network, node, not a list"),
    ("cluster.json", "{}", r"a cluster file ends in .toml, .yaml or .yml, not '.json'"),
])
def test_bad_yaml_and_other_formats_are_one_line_too(tmp_path, name, text, match):
    with pytest.raises(ConfigError, match=match) as caught:
        load_cluster(write(tmp_path, text, name))
    assert "\n" not in str(caught.value)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"nowhere.toml: no such cluster file"):
        load_cluster(tmp_path / "nowhere.toml")


@pytest.mark.parametrize("text, expected", [(1e9, 1e9), ("1e9", 1e9), ("10Gbit/s", 1.25e9), ("1 Gbit/s", 1.25e8),
                                            ("100Mbit/s", 12.5e6), ("64kbit/s", 8e3), ("12GB/s", 12e9),
                                            ("500MB/s", 5e8)])
def test_bandwidths_are_bytes_per_second(text, expected):
    assert parse_bandwidth(text) == expected


@pytest.mark.parametrize("text, expected", [(0.001, 0.001), (0, 0.0), ("50us", 50e-6), ("50µs", 50e-6),
                                            ("0.2ms", 0.2e-3), ("1ms", 1e-3), ("2s", 2.0), ("0.5", 0.5)])
def test_latencies_are_seconds(text, expected):
    assert parse_latency(text) == expected


@pytest.mark.parametrize("text, expected", [("35.6T", 35.6e12), ("35.6 TFLOP/s", 35.6e12), ("312e12", 312e12),
                                            (7e9, 7e9), ("50G", 50e9)])
def test_flops_are_powers_of_1000(text, expected):
    assert parse_flops(text) == expected


@pytest.mark.parametrize("text, expected", [("24G", 24 * GiB), ("24GiB", 24 * GiB), ("512M", 512 << 20),
                                            (1000, 1000)])
def test_memory_sizes_are_powers_of_1024_as_memory_budget(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("parse, value", [(parse_bandwidth, "25GbE"), (parse_bandwidth, float("inf")),
                                          (parse_latency, "-1ms"), (parse_flops, 0), (parse_memory, True)])
def test_parsers_refuse_what_they_cannot_read(parse, value):
    with pytest.raises(ValueError):
        parse(value)


@pytest.mark.parametrize("name", ["A100-80GB", "a100_80gb", "A100 80GB", "a10080gb", "rtx-3090", "H100_sxm"])
def test_catalogue_lookups_ignore_case_dashes_underscores_and_spaces(name):
    assert device_kind(name) is CATALOGUE[{"rtx-3090": "RTX3090", "H100_sxm": "H100-SXM"}.get(name, "A100-80GB")]


def test_an_unknown_kind_lists_the_known_ones_and_the_measured_way_out():
    with pytest.raises(ConfigError, match=r"unknown device kind 'RTX3080'.*GTX1080Ti, .*H100-SXM.*measured") as caught:
        device_kind("RTX3080")
    assert "\n" not in str(caught.value)


REQUIRED_KINDS = ["GTX1080Ti", "P100-16GB", "V100-16GB", "V100-32GB", "T4", "RTX2080Ti", "RTX3090", "RTX4090",
                  "RTXA6000", "A10", "A40", "L4", "L40S", "A100-40GB", "A100-80GB", "H100-PCIe", "H100-SXM"]


def test_the_catalogue_has_the_common_cards():
    assert set(REQUIRED_KINDS) <= set(CATALOGUE)


@pytest.mark.parametrize("kind", CATALOGUE.values(), ids=list(CATALOGUE))
def test_every_catalogue_entry_is_plausible(kind):
    assert kind.memory > 0 and kind.memory_bandwidth > 0 and kind.flops["fp32"] > 0
    assert set(kind.flops) <= {"fp32", "fp16", "bf16"}
    assert all(kind.flops[p] >= kind.flops["fp32"] for p in ("fp16", "bf16") if p in kind.flops)
    assert "http" in kind.source and kind.name == device_kind(kind.name).name


def test_bf16_is_absent_where_the_card_has_none():
    assert not any("bf16" in CATALOGUE[name].flops for name in ["V100-16GB", "T4", "GTX1080Ti", "RTX2080Ti"])


def test_the_docs_table_is_the_catalogue():
    page = (REPO_ROOT / "docs" / "cluster-file.md").read_text()
    assert catalogue_table() in page, "regenerate the table in docs/cluster-file.md with catalogue_table()"


def test_the_cluster_package_imports_no_torch():
    """Planning tools read cluster files on machines without torch: only the stdlib, yaml/tomli and hetfair leaves."""
    allowed = {"hetfair.errors", "hetfair.memory.sizes", "hetfair.cluster", "yaml", "tomli", "__future__"}
    for path in (REPO_ROOT / "hetfair" / "cluster").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert (name.split(".")[0] in sys.stdlib_module_names or name in allowed
                        or name.startswith("hetfair.cluster.")), f"{path.name} imports {name}"

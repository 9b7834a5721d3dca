"""Nodes on separate hosts of a real network: network namespaces joined by a bridge (see netns.py).

Each host maps the machine's hostname to 127.0.0.1, as many ``/etc/hosts`` do, which is
what gloo binds to by default; reverse lookups fail there (no name server), as for most
addresses on a cluster's network (see multi_host.py).
"""

from __future__ import annotations

import ipaddress
import os

import pytest
import torch

from helpers import TOY_PLUGIN, final_parameters, rank_flags
from hetfair.launch.network import (
    GLOO_INTERFACE_ENV,
    NCCL_INTERFACE_ENV,
    interface_addresses,
    interface_towards,
    use_interface,
)
from hetfair_cli.train import main as train_main
from multi_host import HOSTNAME_MEANS_LOOPBACK, finish, start_nodes
from toy_reference import assert_same, reference_parameters


def test_two_hosts_whose_hostname_means_loopback_train_and_print_nothing(make_network, tmp_path):
    """gloo would bind to 127.0.0.1 and the ranks would fail to connect ("Gloo connectFullMesh failed"): the
    ranks use the interface towards rank 0's address instead. No C++ warning reaches the terminal either."""
    network = make_network(2, etc=HOSTNAME_MEANS_LOOPBACK)
    for code, err in finish(start_nodes(network, tmp_path)):
        assert (code, err) == (0, "")
    assert_same(final_parameters(tmp_path / "ckpt"), reference_parameters(update_size=32))


def test_an_interface_that_does_not_reach_the_others_is_one_line_naming_it_and_where_it_came_from(make_network,
                                                                                                 tmp_path):
    """Node 0 is given the loopback interface by --distributed-interface, node 1 by a GLOO_SOCKET_IFNAME in the
    user's environment (which wins over the interface towards rank 0): neither can connect, each says which
    interface it used and, for the environment's, from where."""
    network = make_network(2, etc=HOSTNAME_MEANS_LOOPBACK)
    # a timeout long enough for both ranks to check in under load: it is gloo's connection that must fail
    procs = start_nodes(network, tmp_path, "--distributed-timeout", "10",
                        own=[(("--distributed-interface", "lo"), {}), ((), {GLOO_INTERFACE_ENV: "lo"})])
    (code0, err0), (code1, err1) = finish(procs)
    [line0], [line1] = err0.splitlines(), err1.splitlines()  # no traceback, no C++ lines
    assert (code0, code1) == (2, 2)
    assert line0.endswith("--distributed-interface with the network interface that reaches the others (this "
                          "node used lo)"), line0
    assert line1.endswith(f"(this node used lo, from {GLOO_INTERFACE_ENV})"), line1


def test_an_unknown_interface_is_one_line(tmp_path, capsys):
    code = train_main(["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--max-epoch", "1",
                       "--save-dir", str(tmp_path / "c"), *rank_flags(0, 2, "tcp://127.0.0.1:29500"),
                       "--distributed-interface", "no-such-nic0"])
    [line] = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert line.startswith("hetfair-train: error: --distributed-interface no-such-nic0: this machine has no "
                           "network interface of that name; it has lo")


@pytest.mark.parametrize("address", ["127.0.0.1", "::1"])
def test_the_way_to_a_loopback_address_is_the_loopback_interface(address):
    if ipaddress.ip_address(address) not in {held for _, held in interface_addresses()}:
        pytest.skip(f"this machine has no {address}")
    assert interface_towards(address, "localhost") == "lo"


@pytest.mark.parametrize("device, expected", [("cpu", {GLOO_INTERFACE_ENV: "eth1"}),
                                              ("cuda", {GLOO_INTERFACE_ENV: "eth1", NCCL_INTERFACE_ENV: "eth1"})])
def test_the_flag_overrides_the_users_interface_and_the_choice_does_not(monkeypatch, device, expected):
    monkeypatch.setenv(GLOO_INTERFACE_ENV, "ib0")
    monkeypatch.delenv(NCCL_INTERFACE_ENV, raising=False)
    use_interface("eth1", torch.device(device), override=False)  # the choice towards the rendezvous host
    assert os.environ[GLOO_INTERFACE_ENV] == "ib0"
    use_interface("eth1", torch.device(device), override=True)  # --distributed-interface
    assert {name: os.environ.get(name) for name in expected} == expected

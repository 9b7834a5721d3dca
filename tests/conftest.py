import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from forked_cli import serve_on_demand  # noqa: E402
from netns import Network, unavailable  # noqa: E402

# Files whose tests hold deadlines on peers (a lost rank noticed within seconds, a hang turned into an
# error, a signal answered in time): `make test` runs them after the rest, in two groups side by side on
# two pytest-xdist workers (`--dist loadgroup`), each group's files one after another. Each of these files
# keeps about one core busy (measured: 0.8-1.3), so two at a time fill a 2-core machine without the
# oversubscription a worker of the first pass would add. The groups take about equal time (131 s and
# 145 s of their files' time alone, quiet).
SERIAL_GROUPS = {
    **dict.fromkeys(["test_live_recovery.py", "test_live_security.py", "test_third_host.py", "test_preemption.py",
                     "test_teardown.py"], "serial-1"),
    **dict.fromkeys(["test_signals_and_hangs.py", "test_rendezvous_security.py", "test_elastic_torchrun.py",
                     "test_cluster_model_netns.py"], "serial-2"),
}


def pytest_sessionstart(session: pytest.Session) -> None:
    serve_on_demand()  # from the environment no test has changed yet


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        group = SERIAL_GROUPS.get(item.path.name)
        if group is not None:
            item.add_marker(pytest.mark.serial)
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture
def make_network():
    """``make_network(count, etc={...})``: a :class:`netns.Network` of ``count`` hosts, removed after the test.

    Skips the test, with the reason, where network namespaces cannot be made.
    """
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    made = []

    def make(count: int, **options) -> Network:
        network = Network(count, **options)
        network.create()
        made.append(network)
        return network

    yield make
    for network in made:
        network.remove()

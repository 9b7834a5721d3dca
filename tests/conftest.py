import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from forked_cli import serve_on_demand  # noqa: E402
from netns import Network, unavailable  # noqa: E402

# Files whose tests hold deadlines on peers (a lost rank noticed within seconds, a hang turned into an
# error, a signal answered in time): `make test` runs them after the rest, alone, so that a second
# pytest worker cannot starve them on a 2-core machine. Everything else runs on pytest-xdist workers.
SERIAL_FILES = frozenset({
    "test_live_recovery.py", "test_live_security.py", "test_signals_and_hangs.py", "test_preemption.py",
    "test_third_host.py", "test_rendezvous_security.py", "test_elastic_torchrun.py", "test_teardown.py",
})


def pytest_sessionstart(session: pytest.Session) -> None:
    serve_on_demand()  # from the environment no test has changed yet


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in SERIAL_FILES:
            item.add_marker(pytest.mark.serial)


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

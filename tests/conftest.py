import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from netns import Network, unavailable  # noqa: E402


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

"""Under torchrun, each start of the workers meets in a store of its own, never in an earlier start's keys.

torchrun's agent store outlives the workers; what an earlier start left there (its store's
address) must be ignored. Real TCPStores on 127.0.0.1: the agent's, and the ones ranks host.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from helpers import free_port
from hetfair.launch.agent_store import fresh_store, join_warning
from hetfair.errors import DistributedError


@pytest.fixture
def agent_env() -> tuple[dist.TCPStore, dict[str, str]]:
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    return agent, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def test_a_restarted_rank_skips_what_an_earlier_start_published_and_meets_rank_0s_new_store(agent_env):
    agent, env = agent_env
    other = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    other.set("hetfair/nonce", "other")
    agent.set("hetfair/worker_store", f"{free_port()}|gone")  # an earlier start's store, closed since
    found: list[dist.Store] = []
    rank1 = threading.Thread(target=lambda: found.append(fresh_store(env, 1, 2, timeout=30, secret=None)))
    rank1.start()
    agent.set("hetfair/worker_store", f"{other.port}|earlier")  # alive, but not the one it names
    rank0 = fresh_store(env, 0, 2, timeout=30, secret=None)
    rank1.join()
    rank0.set("greeting", "from rank 0")
    assert found[0].get("greeting") == b"from rank 0"


def test_with_a_secret_a_store_published_by_another_client_is_never_taken(agent_env):
    agent, env = agent_env
    planted = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    planted.set("hetfair/nonce", "planted")
    agent.set("hetfair/worker_store", f"{planted.port}|planted")  # alive, holding the nonce it names: unsigned
    found: list[dist.Store] = []
    rank1 = threading.Thread(target=lambda: found.append(fresh_store(env, 1, 2, timeout=30, secret=b"job")))
    rank1.start()
    time.sleep(1.0)  # rank 1 reads the planted value meanwhile
    assert not found
    rank0 = fresh_store(env, 0, 2, timeout=30, secret=b"job")
    rank1.join()
    rank0.set("greeting", "from rank 0")
    assert found[0].get("greeting") == b"from rank 0"


def test_a_start_whose_rank_0_never_publishes_fails_with_one_line_within_the_timeout(agent_env):
    agent, env = agent_env
    agent.set("hetfair/worker_store", f"{free_port()}|gone")
    with pytest.raises(DistributedError, match=r"^rank 1: rank 0 published no store of this start within 1s; "):
        fresh_store(env, 1, 2, timeout=1, secret=None)


def test_a_restartable_job_on_torchruns_shared_store_is_told_how_nodes_can_join():
    shared = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3"}
    assert "set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in join_warning(shared)
    assert join_warning({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None  # a new store every start
    assert join_warning({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None  # never restarts

"""What a third host on the job's network can and cannot do, and the user's own ``GLOO_SOCKET_IFNAME``.

Three network namespaces on one bridge (see netns.py): the job's two nodes on hosts 0 and 1, an
outsider on host 2 that reaches rank 0's store (``tcp://10.231.0.1``) as any machine of that
network would. The job runs with ``HETFAIR_SECRET``; the outsider has no secret, or another one.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import final_parameters, rank_flags
from hetfair.launch.network import GLOO_INTERFACE_ENV
from hetfair.launch.rendezvous import SECRET_ENV
from forked_cli import ForkedCommand
from multi_host import HOSTNAME_MEANS_LOOPBACK, finish, node_env, start_nodes, start_on
from toy_reference import assert_same, reference_parameters, toy_train_args

_OUTSIDER = """
import sys
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore(sys.argv[1], int(sys.argv[2]), 2, is_master=False, timeout=timedelta(seconds=120))
store.wait(["hetfair/world_size"])  # rank 0's check-in has begun
published = store.get("hetfair/world_size").decode()  # every key is readable: signature:2|nonce
if sys.argv[3] == "forge":  # an abort, and rank 1's arrival with the nonce read, not signed with the secret
    store.set("hetfair/abort", "INJECTED: stop the job")
    store.set("hetfair/arrived/1", "0" * 64 + ":" + published.rsplit("|", 1)[1])
else:  # rank 0's world size overwritten
    store.set("hetfair/world_size", "2|" + "0" * 16)
print(published)
"""


def start_rank(network, host: int, rank: int, tmp_path: Path, secret: str | None, timeout: int) -> ForkedCommand:
    """Rank ``rank`` of the job's toy run (batch 12 on rank 0, 20 on rank 1) on host ``host``, with ``secret``."""
    init = "tcp://10.231.0.1:29500"
    args = toy_train_args(tmp_path / "ckpt", 1) + ["--max-sentences", ("12", "20")[rank], *rank_flags(rank, 2, init),
                                                   "--distributed-timeout", str(timeout)]
    env = {name: value for name, value in node_env().items() if name != SECRET_ENV}
    if secret is not None:
        env[SECRET_ENV] = secret
    return start_on(network, host, args, tmp_path, env)


def outsider(host, action: str) -> str:
    """Run the outsider's store client on ``host``; what it read of rank 0's world size."""
    done = subprocess.run(host.command(sys.executable, "-c", _OUTSIDER, "10.231.0.1", "29500", action),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def one_line(proc: ForkedCommand) -> tuple[int, str]:
    _, err = proc.communicate(timeout=240)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # no traceback, no C++ lines
    return proc.returncode, lines[0]


def test_a_third_host_without_the_secret_is_refused_and_the_job_trains_on(make_network, tmp_path):
    """The outsider forges an abort and rank 1's arrival in rank 0's store, then starts a node of its own as
    rank 1, without a secret and with another one: each is refused, and the job's real rank 1, started after
    them, trains to the same parameters as plain PyTorch."""
    network = make_network(3, etc=HOSTNAME_MEANS_LOOPBACK)
    rank0 = start_rank(network, 0, 0, tmp_path, "the job's secret", timeout=120)
    procs = [rank0]
    try:
        assert outsider(network.hosts[2], "forge").partition(":")[2].startswith("2|")  # it reads the keys
        (tmp_path / "outsider").mkdir()
        code, line = one_line(start_rank(network, 2, 1, tmp_path / "outsider", None, timeout=3))
        assert code == 2 and f"same secret in the {SECRET_ENV} environment variable" in line, line
        code, line = one_line(start_rank(network, 2, 1, tmp_path / "outsider", "a guess", timeout=3))
        assert code == 2 and line.endswith(f"not signed with this node's secret: give every node the same "
                                           f"{SECRET_ENV})"), line
        procs.append(start_rank(network, 1, 1, tmp_path, "the job's secret", timeout=120))
        results = finish(procs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert results == [(0, ""), (0, "")]
    assert_same(final_parameters(tmp_path / "ckpt"), reference_parameters(update_size=32))


def test_a_third_host_can_stop_the_check_in_and_the_node_says_so_in_one_line(make_network, tmp_path):
    """What the secret does not prevent: the store's keys can be overwritten (denial of service). Rank 1 then
    never sees a world size signed by rank 0, and ends after its timeout with one line pointing at the secret,
    instead of joining a forged job or hanging. (Rank 0 would wait for its own, longer timeout: stopped here.)"""
    network = make_network(3, etc=HOSTNAME_MEANS_LOOPBACK)
    rank0 = start_rank(network, 0, 0, tmp_path, "the job's secret", timeout=120)
    try:
        outsider(network.hosts[2], "overwrite")
        code, line = one_line(start_rank(network, 1, 1, tmp_path, "the job's secret", timeout=3))
    finally:
        rank0.kill()
        rank0.wait()
    assert code == 2
    assert line == (f"hetfair-train: error: [rank 1] rank 0 did not check in within 3s; start rank 0's command or "
                    f"check --distributed-init-method (the store holds check-in values not signed with this node's "
                    f"secret: give every node the same {SECRET_ENV})")
    assert not (tmp_path / "ckpt" / "checkpoint_last.pt").exists()


def test_the_flag_wins_over_the_users_gloo_interface_across_hosts(make_network, tmp_path):
    network = make_network(2, etc=HOSTNAME_MEANS_LOOPBACK)
    env = {**node_env(), GLOO_INTERFACE_ENV: "lo"}
    for code, err in finish(start_nodes(network, tmp_path, "--distributed-interface", "eth0", env=env)):
        assert (code, err) == (0, "")
    assert_same(final_parameters(tmp_path / "ckpt"), reference_parameters(update_size=32))

"""Who may take part in a live job: the lighthouse's records are hidden and signed, peers' state is never unpickled.

In-process checks of the records and the state transfer (a store server on a free loopback port), the
lighthouse's own bad input, and one job on three network namespaces (tests/netns.py) attacked from the third:
it reads, forges, deletes, joins without the secret and with another one; the job trains on to the parameters
of plain PyTorch and says nothing, the attacker gets one line.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from helpers import final_parameters, subprocess_env
from hetfair.errors import ConfigError, DistributedError
from hetfair.launch.rendezvous import SECRET_ENV
from hetfair.live.membership import JobEnded, Member, Membership
from hetfair.live.records import JOB_KEY, JobRecords
from hetfair.live.state_transfer import decode_state, encode_state
from multi_host import HOSTNAME_MEANS_LOOPBACK, node_env
from test_live_recovery import LIGHTHOUSE, Job, _preempt_all, _updates_after, lighthouse_process
from toy_reference import assert_same, reference_parameters

SECRET = b"the job's secret"


@pytest.fixture
def server() -> dist.TCPStore:
    """A store server on a free loopback port (the lighthouse's store, in this process)."""
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)


def client(server: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, None, False, timeout=timedelta(seconds=10))


def test_records_are_hidden_under_the_secret_and_only_signed_values_are_read(server):
    records = JobRecords(client(server), SECRET)
    records.set("latest", "4")
    assert records.get("latest") == "4"
    assert not server.check(["hetfair/live/latest"])  # not where a stranger would look
    assert JobRecords(client(server), b"a guess").get("latest") is None  # another secret: another namespace
    records.store.set("latest", "9")  # a stranger who found the key: unsigned
    assert records.get("latest") is None
    records.store.set("finished", "0" * 64 + ":1")  # signed with something else
    assert records.get("finished") is None


def test_a_forged_decision_is_not_read_and_the_round_is_decided_over_it(server):
    records = JobRecords(client(server), SECRET)
    forged = json.dumps([["stranger", [9, 9, 9]]])
    records.store.set("r2/closed", forged)  # written first: an unchecked compare_set would keep it
    assert records.get("r2/closed") is None
    records.decide("r2/closed", json.dumps([["a", None]]))
    records.decide("r2/closed", json.dumps([["b", None]]))  # a signed decision stands
    assert json.loads(records.get("r2/closed")) == [["a", None]]


def test_membership_ignores_a_forged_round_and_end(server):
    """A forged decision naming a stranger with the newest state, and a forged end, as the review's attacker wrote
    them (but under the job's own prefix): neither is a round nor the end of the job."""
    membership = Membership(lambda: JobRecords(client(server), SECRET), 1, 10.0, 3.0)
    try:
        group = membership.next_group(None)
        assert [m.uid for m in group.members] == [membership.uid] and group.round == 1
        membership.store.set("r2/closed", json.dumps([["stranger", [1, 0, 10**9]]]))
        membership.store.set("finished", "1")
        membership.store.set("latest", "1000")
        assert membership._decision(2) is None
        assert membership.next_group((1, 4, 3)).members == (Member(membership.uid, (1, 4, 3)),)
        membership.finish()
        with pytest.raises(JobEnded, match="ended without this process: it was dropped after round 2"):
            membership.next_group((1, 4, 3))  # as a member that was dropped would find it
    finally:
        membership.close()


def test_another_secret_at_the_lighthouse_is_one_line(server):
    JobRecords(client(server), SECRET).claim("tcp://127.0.0.1:1")
    JobRecords(client(server), SECRET).claim("tcp://127.0.0.1:1")  # the job's own: fine
    with pytest.raises(ConfigError, match=f"is signed with another secret than this process's; give every process "
                                          f"of the job the same {SECRET_ENV}"):
        JobRecords(client(server), b"a guess").claim("tcp://127.0.0.1:1")


def test_a_forged_proof_does_not_keep_the_jobs_own_processes_out(server):
    JobRecords(client(server), SECRET).claim("tcp://127.0.0.1:1")
    JobRecords(client(server), SECRET).set("latest", "3")  # a job runs
    server.set(JOB_KEY, "0" * 64 + ":a hetfair live job")
    JobRecords(client(server), SECRET).claim("tcp://127.0.0.1:1")  # a joiner of the job: the proof is mended
    with pytest.raises(ConfigError):
        JobRecords(client(server), b"a guess").claim("tcp://127.0.0.1:1")


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_state_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    buffer = io.BytesIO()
    torch.save({"trainer": _RunsCode(marker)}, buffer)  # what a stranger's pickled "state" would be
    payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    with pytest.raises(DistributedError, match=r"^the state rank 1 sent is not a hetfair run's state \("):
        decode_state(payload, 1)
    assert not marker.exists()
    state = {"model": {"w": torch.arange(3.0)}, "position": {"epoch": 1}, "best_metric": None}
    decoded = decode_state(encode_state(state), 0)
    assert torch.equal(decoded["model"]["w"], state["model"]["w"]) and decoded["position"] == {"epoch": 1}


@pytest.mark.parametrize("flags,message", [
    (("--port", "99999"), "--port 99999 is not a TCP port: give 1-65535, or 0 for a free one"),
    (("--port", "-1"), "--port -1 is not a TCP port: give 1-65535, or 0 for a free one"),
    (("--host", "no-such-host.invalid", "--port", "0"), "--host no-such-host.invalid: no such address"),
])
def test_the_lighthouse_refuses_bad_input_in_one_line(flags, message):
    done = subprocess.run([*LIGHTHOUSE, *flags], env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"hetfair-lighthouse: error: {message}"), done.stderr


def test_a_taken_port_is_one_line():
    with lighthouse_process() as (address, _):
        port = address.rsplit(":", 1)[1]
        done = subprocess.run([*LIGHTHOUSE, "--port", port], env=subprocess_env(), capture_output=True, text=True,
                              timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"hetfair-lighthouse: error: cannot listen on 127.0.0.1 port {port}: "), done.stderr


_ATTACKER = """
import json, sys
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore(sys.argv[1], int(sys.argv[2]), None, False, timeout=timedelta(seconds=60))
# read: where the job's records were (before they were hidden), and how many keys there are
names = ["hetfair/live/latest", "hetfair/live/r1/closed", "hetfair/live/r1/arrived", "hetfair/live/r1/uid/1"]
found = {name: store.get(name).decode() for name in names if store.check([name])}
# forge: a round naming a stranger with the newest state, the job's end; delete what it can name
store.set("hetfair/live/r2/closed", json.dumps([["stranger", [1, 0, 10**9]]]))
store.set("hetfair/live/finished", "1")
store.set("hetfair/live/latest", "1000")
store.add("hetfair/live/r2/arrived", 1)
for name in names:
    store.delete_key(name)
print(json.dumps({"found": found, "keys": store.num_keys()}))
"""


def test_a_third_host_cannot_read_join_forge_or_stop_a_live_job(make_network, tmp_path):
    network = make_network(3, etc=HOSTNAME_MEANS_LOOPBACK)
    lighthouse_host, attacker = network.hosts[0], network.hosts[2]
    env = node_env()  # HETFAIR_SECRET set
    with lighthouse_process(*lighthouse_host.command(), host=lighthouse_host.address) as (address, _), \
            lighthouse_process(*lighthouse_host.command(), port=29401):  # on its loopback only, by default
        job = Job(tmp_path, address, "5", "--distributed-world-size", "2", "--global-batch-size", "16",
                  "--toy-step-seconds", "0.01", "--lr", "0.05")
        try:
            ranks = job.by_rank([job.start(batch, host=host, env=env)
                                 for batch, host in ((12, network.hosts[0]), (4, network.hosts[1]))], 1)
            master = ranks[0]
            line = master.wait_for(r"num_updates 5 ")
            unreachable = subprocess.run(attacker.command(sys.executable, "-c", _CONNECTS, lighthouse_host.address,
                                                          "29401"), capture_output=True, text=True, timeout=60)
            assert unreachable.stdout.strip() == "refused", unreachable.stderr
            done = subprocess.run(attacker.command(sys.executable, "-c", _ATTACKER, lighthouse_host.address,
                                                   address.rsplit(":", 1)[1]), capture_output=True, text=True,
                                  timeout=120)
            assert done.returncode == 0, done.stderr
            assert json.loads(done.stdout)["found"] == {}  # nothing of the job where a stranger can look
            (tmp_path / "stranger").mkdir()
            stranger = Job(tmp_path / "stranger", address, "5", "--distributed-world-size", "2")
            for secret, says in ((None, f"give every node's command the same secret in the {SECRET_ENV}"),
                                 ("a guess", "is signed with another secret than this process's")):
                stranger_env = {name: value for name, value in env.items() if name != SECRET_ENV}
                stranger_env.update({SECRET_ENV: secret} if secret else {})
                intruder = stranger.start(4, host=attacker, env=stranger_env)
                assert intruder.proc.wait(timeout=120) == 2, intruder.text()
                intruder.wait_for(".")
                assert len(intruder.lines) == 1 and says in intruder.lines[0], intruder.text()
            _updates_after(master, line, 10)  # the job trains on, in its first round
            _preempt_all(ranks)
            for rank in ranks:
                assert not any(" round 2" in text or "error" in text for text in rank.lines), rank.text()
            job.assert_quiet()
        finally:
            job.close()
    updates = torch.load(job.save_dir / "checkpoint_last.pt", weights_only=True)["trainer"]["num_updates"]
    assert_same(final_parameters(job.save_dir),
                reference_parameters(16, train_size=100_000, updates=updates, lr=0.05))


_CONNECTS = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10).close()
    print("connected")
except ConnectionRefusedError:
    print("refused")
"""

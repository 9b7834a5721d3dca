"""The multi-node recipes of the README and the docs pages, and docs/auto-plan.md's command, run as typed.

Each recipe is read from its page's ```bash blocks (one per node) and run by bash in a "checkout": a
directory holding the repository's ``plugins`` and ``benchmarks`` and this test's virtual environment as
``.venv``, which the blocks activate themselves. Two nodes are two network namespaces (tests/netns.py)
named ``nodeA`` and ``nodeB``: each has that host name, and its ``/etc/hosts`` gives both names their
namespace's address, so the blocks need no address replaced. Node B's block reads the secret from its
terminal (here: its standard input), as a user pastes what node A's printed. The SLURM batch script
runs in one bash whose ``srun`` starts its task on each of the two nodes with the environment srun
gives it. docs/multi-node.md's recipes train on 640 images of Fashion-MNIST (``--max-images 640``)
as typed; the README's trains on all of it, so there ``--dataset fashion-mnist`` becomes a small
directory of random images, and a CPU process's ``--max-sentences auto`` gets the budget the README
asks for without a GPU. docs/slow-links.md's two commands run on a link shaped to 10 Mbit/s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO

import pytest

from helpers import REPO_ROOT, subprocess_env
from hetfair.launch.network import GLOO_INTERFACE_ENV, NCCL_INTERFACE_ENV
from hetfair.launch.rendezvous import SECRET_ENV
from netns import SUBNET, Network
from test_auto_plan import plan_line, plan_rows
from test_mnist_plugin import PLUGIN_DIR, needs_fashion_mnist, write_mnist_dir

NODES = ("nodeA", "nodeB")
VENV = Path(sys.prefix)
TIMEOUT = 300


def page_block(first_line: str) -> str:
    """The ```bash block of the README or a docs page whose first line is ``first_line``."""
    pages = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    blocks = [block for page in pages for block in page.read_text().split("```bash\n")[1:]]
    [block] = [b.split("```")[0] for b in blocks if b.startswith(first_line + "\n")]
    return block


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """Where the blocks run: the repository's plugins and benchmarks, and the virtual environment as .venv."""
    if not (VENV / "bin" / "activate").is_file():
        pytest.skip(f"the recipes activate .venv, and the tests run outside a virtual environment ({VENV})")
    (tmp_path / ".venv").symlink_to(VENV)
    for name in ("plugins", "benchmarks"):
        (tmp_path / name).symlink_to(REPO_ROOT / name)
    return tmp_path


@pytest.fixture
def two_nodes(make_network) -> Network:
    """Hosts 0 and 1 of a test network, whose /etc/hosts name them nodeA and nodeB."""
    names = "".join(f"{SUBNET}.{index + 1} {name}\n" for index, name in enumerate(NODES))
    return make_network(2, etc={"hosts": f"127.0.0.1 localhost\n{names}", "resolv.conf": ""})


def shell_env() -> dict[str, str]:
    """A user's environment before the blocks run: no secret, no interface chosen, the venv not active."""
    env = {name: value for name, value in subprocess_env().items()
           if name not in (SECRET_ENV, GLOO_INTERFACE_ENV, NCCL_INTERFACE_ENV, "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join(part for part in env["PATH"].split(os.pathsep) if Path(part) != VENV / "bin")
    return env


def on_node(network: Network, index: int, script: str, cwd: Path, stderr: IO[str]) -> subprocess.Popen:
    """``script`` run by bash -e on host ``index`` of ``network``, under that node's host name."""
    command = network.hosts[index].command("unshare", "--uts", "bash", "-c", 'hostname "$0" && exec bash -e -c "$1"',
                                           NODES[index], script)
    return subprocess.Popen(command, cwd=cwd, env=shell_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=stderr, text=True, start_new_session=True)


def run_pair(network: Network, scripts: tuple[str, str], cwd: Path,
             secret_from_a: bool = False) -> list[tuple[int, str]]:
    """Node A's and node B's scripts at once, each node's exit code and stderr; with ``secret_from_a``, node B
    is given the line node A prints first."""
    logs = [tempfile.TemporaryFile("w+") for _ in scripts]  # no pipe to fill while the other node is waited for
    nodes = [on_node(network, index, script, cwd, log) for index, (script, log) in enumerate(zip(scripts, logs))]
    try:
        typed = nodes[0].stdout.readline() if secret_from_a else None
        assert typed is None or len(typed.strip()) == 32, typed
        nodes[1].communicate(typed, timeout=TIMEOUT)  # node B first: it may wait for what is typed
        nodes[0].communicate(timeout=TIMEOUT)
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
    return [(node.returncode, read_back(log)) for node, log in zip(nodes, logs)]


def read_back(log: IO[str]) -> str:
    """What was written to ``log``, which is then closed."""
    with log:
        log.seek(0)
        return log.read()


def assert_both_succeeded(results: list[tuple[int, str]]) -> str:
    """Both nodes' stderr, joined, after checking that both exited 0."""
    for code, err in results:
        assert code == 0, err[-3000:]
    return "".join(err for _, err in results)


def on_small_data(script: str, data: Path) -> str:
    """The README's command on a small data set, with the memory budget it asks for on a CPU."""
    return (script.replace("--dataset fashion-mnist", f"--data {data}")
            .replace("--max-sentences auto", "--max-sentences auto --memory-budget 4G"))


def test_the_readme_two_node_recipe_runs_as_typed(two_nodes, checkout):
    (checkout / "data").mkdir()
    data = write_mnist_dir(checkout / "data", n_train=80)  # 72 after the held-out tenth: above node A's 48
    scripts = (on_small_data(page_block("# node A: the job's secret, then rank 0"), data),
               on_small_data(page_block("# node B: the secret node A printed, then rank 1"), data))
    results = run_pair(two_nodes, scripts, checkout, secret_from_a=True)
    assert_both_succeeded(results)
    err_a = results[0][1]
    assert "plan | --ddp-backend c10d: every rank holds the model's state" in err_a, err_a
    assert "per-rank batch rank 0: 72, rank 1: 72 |" in err_a, err_a  # both hold the 72 training images
    assert (checkout / "checkpoints" / "two-nodes" / "checkpoint_last.pt").exists()


@needs_fashion_mnist
def test_the_multi_node_tcp_recipe_runs_as_typed(two_nodes, checkout):
    scripts = (page_block("# node A, batch 48: the job's secret, then rank 0"),
               page_block("# node B, batch 16: the secret node A printed, then rank 1"))
    results = run_pair(two_nodes, scripts, checkout, secret_from_a=True)
    assert_both_succeeded(results)
    err_a = results[0][1]
    assert "per-rank batch rank 0: 48, rank 1: 16 |" in err_a, err_a
    assert "done | num_updates 10 |" in err_a, err_a  # the page's "a quick trial of 10 updates"
    assert (checkout / "checkpoints" / "two-nodes" / "checkpoint_last.pt").exists()


@needs_fashion_mnist
def test_the_multi_node_torchrun_recipe_runs_as_typed(two_nodes, checkout):
    scripts = (page_block("# node A under torchrun, batch 48 (it hosts the rendezvous)"),
               page_block("# node B under torchrun, batch 16"))
    err = assert_both_succeeded(run_pair(two_nodes, scripts, checkout))
    assert ("per-rank batch rank 0: 48, rank 1: 16 |" in err) != ("per-rank batch rank 0: 16, rank 1: 48 |" in err), err
    assert "done | num_updates 10 |" in err, err
    assert (checkout / "checkpoints" / "two-nodes" / "checkpoint_last.pt").exists()


def test_the_slow_links_per_node_commands_run_as_typed(two_nodes, checkout):
    for index in range(2):
        two_nodes.shape(index, "10mbit")
    scripts = (page_block("# node A over a slow link: the job's secret, then rank 0"),
               page_block("# node B over a slow link: the secret node A printed, then rank 1"))
    results = run_pair(two_nodes, scripts, checkout, secret_from_a=True)
    assert_both_succeeded(results)
    err_a = results[0][1]
    assert "per-rank batch rank 0: 24, rank 1: 8 |" in err_a and "done | num_updates 6 |" in err_a, err_a
    [comm, *outer] = [line for line in err_a.splitlines() if line.startswith("comm | ")]
    assert "powersgd (lossy)" in comm, comm
    assert all(line.startswith("comm | even powersgd (lossy) takes") for line in outer), outer  # no hook will do
    assert (checkout / "checkpoints" / "slow-links" / "checkpoint_last.pt").exists()


def test_the_pipeline_two_node_commands_run_as_typed(two_nodes, checkout):
    """docs/pipeline.md: the data block once (both nodes share this checkout), then each node's block at once over a
    100 Mbit/s link; the stages split by measured speed and the plan | lines show them."""
    for index in range(2):
        two_nodes.shape(index, "100mbit")
    prepared = subprocess.run(["bash", "-e", "-c", page_block("# pipeline data: a small causal-LM corpus")],
                              cwd=checkout, env=shell_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    scripts = (page_block("# pipeline node A: the job's secret, then stage 0"),
               page_block("# pipeline node B: the secret node A printed, then stage 1"))
    err_a = assert_both_succeeded(run_pair(two_nodes, scripts, checkout, secret_from_a=True))
    stages = [line for line in err_a.splitlines() if line.startswith("plan | pipeline stage")]
    assert len(stages) == 2 and "done | num_updates 6 |" in err_a, err_a[-3000:]
    assert all("ms per micro-batch of 4 (predicted)" in line for line in stages), stages
    assert (checkout / "checkpoints" / "pipeline" / "checkpoint_last.pt").exists()
    print("\n".join(stages))


def fake_srun(network: Network) -> str:
    """A bash function ``srun`` that starts its command on the job's two nodes, one task each, as srun does."""
    nodes = " ".join(f"{host.namespace}:{name}" for host, name in zip(network.hosts, NODES))
    return f"""srun() {{
    local pids=() node=0 status=0 host
    for host in {nodes}; do
        SLURM_PROCID=$node SLURM_NODEID=$node SLURM_LOCALID=0 SLURM_NTASKS=2 SLURM_JOB_NUM_NODES=2 \\
            SLURM_TASKS_PER_NODE='1(x2)' SLURM_JOB_NODELIST=nodeA,nodeB \\
            ip netns exec "${{host%%:*}}" unshare --uts bash -c 'hostname "$0" && exec "$@"' "${{host#*:}}" "$@" &
        pids+=($!) && node=$((node + 1))
    done
    for pid in "${{pids[@]}}"; do wait "$pid" || status=$?; done
    return $status
}}
"""


@needs_fashion_mnist
def test_the_slurm_recipe_runs_as_typed(two_nodes, checkout):
    """The batch script as sbatch runs it (in the directory it was submitted from), but for srun."""
    result = subprocess.run(["bash", "-e", "-c", fake_srun(two_nodes) + page_block("#!/bin/bash")], cwd=checkout,
                            env=shell_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "per-rank batch rank 0: 48, rank 1: 16 |" in result.stderr, result.stderr


def test_the_auto_plan_sample_runs_as_typed(checkout):
    """docs/auto-plan.md's command prints the table the page shows: its columns, budgets and choices; the
    micro-batch of the 420M rank depends on the machine (and varies a little), so only its bound is pinned down."""
    block = page_block("# two processes of the simulated cluster, with different memory budgets")
    result = subprocess.run(["bash", "-e", "-c", block], cwd=checkout, env=shell_env(), capture_output=True,
                            text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    [shown] = [block for block in (REPO_ROOT / "docs" / "auto-plan.md").read_text().split("```\n")
               if block.startswith("plan | rank")]
    for start in ("plan | rank", "plan | --ddp-backend ", "dry run | "):  # the lines no measurement changes
        assert plan_line(result.stderr, start) == plan_line(shown, start)
    rows = plan_rows(result.stderr)
    assert [(r["rank"], r["device"], r["budget"], r["precision"], r["shard"]) for r in rows] == \
        [("0", "cpu", "420.0M", "fp32", "whole"), ("1", "cpu", "560.0M", "fp32", "whole")]
    assert rows[1]["micro-batch"] == "300" and rows[1]["why"].startswith("probed: all 300 samples fit (")
    assert 0 < int(rows[0]["micro-batch"]) < 300 and rows[0]["why"].endswith(", 5% margin)")  # memory-bound
    assert sorted(path.name for path in checkout.iterdir()) == [".venv", "benchmarks", "plugins"]  # nothing written

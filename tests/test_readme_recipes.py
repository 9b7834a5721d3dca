"""The two-node recipes of the README (one command, ``auto`` batch sizes) and docs/multi-node.md (node A batch 48,
node B batch 16) run as typed.

Both "nodes" run on this machine. Over ``tcp://`` they are two bash shells running the README's
code blocks: node A's prints the secret it makes, node B's reads it from its terminal (here:
its standard input). The SLURM batch script runs in one bash whose ``srun`` starts the command
twice with the environment srun gives the task of each of two nodes. Only what names the
machines changes: ``nodeA:12345`` becomes 127.0.0.1 and a free port, the MNIST data a small
directory of random images, ``plugins`` the repository's plugin directory, and a CPU process's
``--max-sentences auto`` gets the budget the README asks for without a GPU.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import REPO_ROOT, free_port, subprocess_env
from hetfair.launch.rendezvous import SECRET_ENV
from test_mnist_plugin import PLUGIN_DIR, write_mnist_dir


def readme_block(first_line: str) -> str:
    """The ```bash block of the README or a docs page whose first line is ``first_line``."""
    pages = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    blocks = [block for page in pages for block in page.read_text().split("```bash\n")[1:]]
    [block] = [b.split("```")[0] for b in blocks if b.startswith(first_line + "\n")]
    return block


def on_this_machine(script: str, port: int, data: Path) -> str:
    for typed, here in (("nodeA:12345", f"127.0.0.1:{port}"), ("--distributed-port 12345", f"--distributed-port {port}"),
                        ("--dataset fashion-mnist", f"--data {data}"), ("--user-dir plugins", f"--user-dir {PLUGIN_DIR}"),
                        ("--max-sentences auto", "--max-sentences auto --memory-budget 4G")):
        script = script.replace(typed, here)
    return script


def shell_env() -> dict[str, str]:
    env = {k: v for k, v in subprocess_env().items() if k != SECRET_ENV}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # hetfair-train and python3 as installed
    return env


def small_mnist(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    return write_mnist_dir(data, n_train=80)  # 72 after the held-out tenth: above node A's 48


def test_the_two_node_tcp_recipe_runs_as_typed(tmp_path):
    data = small_mnist(tmp_path)
    port = free_port()
    env = shell_env()
    node_a = subprocess.Popen(
        ["bash", "-e", "-c", on_this_machine(readme_block("# node A: the job's secret, then rank 0"),
                                             port, data)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    node_b = subprocess.Popen(
        ["bash", "-e", "-c", on_this_machine(readme_block("# node B: the secret node A printed, then rank 1"),
                                             port, data)],
        cwd=tmp_path, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        secret = node_a.stdout.readline()
        assert len(secret.strip()) == 32
        _, err_b = node_b.communicate(secret, timeout=300)  # pasted into node B's terminal
        _, err_a = node_a.communicate(timeout=300)
    finally:
        for node in (node_a, node_b):
            if node.poll() is None:
                node.kill()
    assert node_a.returncode == 0, err_a
    assert node_b.returncode == 0, err_b
    assert "plan | --ddp-backend c10d: every rank holds the model's state" in err_a, err_a
    assert "per-rank batch rank 0: 72, rank 1: 72 |" in err_a, err_a  # both hold the 72 training images
    assert (tmp_path / "checkpoints" / "two-nodes" / "checkpoint_last.pt").exists()


FAKE_SRUN = """srun() {  # the job's two nodes, one task each, started as srun starts them
    local pids=() node status=0
    for node in 0 1; do
        SLURM_PROCID=$node SLURM_NODEID=$node SLURM_LOCALID=0 SLURM_NTASKS=2 SLURM_JOB_NUM_NODES=2 \\
            SLURM_TASKS_PER_NODE='1(x2)' SLURM_JOB_NODELIST=127.0.0.1 "$@" & pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
    return $status
}
"""


def test_the_slurm_recipe_runs_as_typed(tmp_path):
    script = on_this_machine(readme_block("#!/bin/bash"), free_port(), small_mnist(tmp_path))
    result = subprocess.run(["bash", "-e", "-c", FAKE_SRUN + script], cwd=tmp_path, env=shell_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "per-rank batch rank 0: 48, rank 1: 16 |" in result.stderr, result.stderr

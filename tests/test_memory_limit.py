"""Under a real memory limit (a cgroup the test makes), even shards get a rank OOM-killed; 1:3 shards train.

Rank 0's command (its launcher and its worker) runs inside the cgroup, rank 1's outside.
The model is a deep, wide MLP (about 40M parameters, each Linear a sharding unit of 4 MiB)
trained with Adam, so its full training state is ``S`` = 16 bytes per parameter (609 MiB).
The baseline ``B`` is the cgroup's peak usage in the same job on a model of a few KiB (the
two interpreters, torch, gloo, the data). Above it, rank 0 peaks at its share of the state
plus the temporaries of Adam's step on its shard and a few gathered units: measured in the
cgroup on this machine, even shards need ``B + 0.63 S`` (386 MiB), 1:3 shards ``B + 0.41 S``
(250 MiB). The limit ``B + 0.52 S`` leaves about ``0.11 S`` (67 MiB) on either side. glibc returns
freed tensors to the kernel at once (a fixed mmap threshold), so resident memory follows
the live tensors rather than the allocator's history.
"""


from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from cgroup import CgroupUnavailable, MemoryCgroup
from helpers import TOY_PLUGIN, free_port, rank_flags, subprocess_env, train_command

WIDTH, DEPTH = 1024, 38
PARAMS = 8 * WIDTH + WIDTH + DEPTH * (WIDTH * WIDTH + WIDTH) + WIDTH * 3 + 3
STATE = 16 * PARAMS  # fp32 parameters and gradients, Adam's two moments
LIMIT_ABOVE_BASELINE = int(0.52 * STATE)


def job(tmp_path: Path, width: int, depth: int, *flags: str) -> list[str]:
    return ["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--arch", "toy_deep", "--toy-width", str(width),
            "--toy-depth", str(depth), "--optimizer", "adam", "--lr", "0.001", "--max-update", "2", "--max-epoch",
            "0", "--max-sentences", "2", "--save-dir", str(tmp_path / "ckpt"), "--no-save", "--log-format", "simple",
            "--disable-validation", "--ddp-backend", "fully_sharded", "--distributed-timeout", "60", *flags]


def run_job(tmp_path: Path, args: list[str], group: MemoryCgroup | None = None) -> list[subprocess.CompletedProcess]:
    """Rank 0 (in ``group``, if any) and rank 1, one command each; both must end by themselves."""
    init = f"tcp://127.0.0.1:{free_port()}"
    env = {**subprocess_env(), "MALLOC_MMAP_THRESHOLD_": "65536"}  # freed tensors leave the resident set
    procs = [subprocess.Popen(train_command(*args, *rank_flags(rank, 2, init)), cwd=tmp_path, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              preexec_fn=group.join if group is not None and rank == 0 else None)
             for rank in range(2)]
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


@pytest.fixture(scope="module")
def limited_group(tmp_path_factory):
    """The cgroup for rank 0's command, limited to ``B + 0.52 S`` (see the module's docstring); removed at the end."""
    try:
        group = MemoryCgroup.create(1 << 40)
    except CgroupUnavailable as exc:
        pytest.skip(f"no memory cgroup can be made here: {exc}")
    try:
        tmp_path = tmp_path_factory.mktemp("baseline")
        rank0, rank1 = run_job(tmp_path, job(tmp_path, 64, 1), group)  # a model of a few KiB: the baseline
        assert rank0.returncode == 0 and rank1.returncode == 0, rank0.stderr + rank1.stderr
        group.set_limit(group.peak_usage() + LIMIT_ABOVE_BASELINE)
        yield group
    finally:
        group.remove()


def test_even_shards_get_the_limited_rank_killed_and_the_job_ends_in_one_line(tmp_path, limited_group):
    kills = limited_group.oom_kills()
    rank0, rank1 = run_job(tmp_path, job(tmp_path, WIDTH, DEPTH), limited_group)
    assert limited_group.oom_kills() > kills, rank0.stderr
    assert rank0.returncode != 0 and rank1.returncode != 0
    errors = [line for line in rank0.stderr.splitlines() if line.startswith("hetfair-train: error:")]
    assert errors == ["hetfair-train: error: the process of rank 0 was killed by signal SIGKILL; the others were "
                      "stopped"], rank0.stderr  # the launcher's line, not a hang


def test_one_to_three_shards_train_under_the_same_limit(tmp_path, limited_group):
    kills = limited_group.oom_kills()
    rank0, rank1 = run_job(tmp_path, job(tmp_path, WIDTH, DEPTH, "--shard-fractions", "1,3"), limited_group)
    assert rank0.returncode == 0 and rank1.returncode == 0, rank0.stderr + rank1.stderr
    assert limited_group.oom_kills() == kills and "num_updates 2" in rank0.stderr

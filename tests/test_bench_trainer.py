"""benchmarks/bench_trainer.py's profile of Trainer.train_step runs against the Trainer as it is now."""

from __future__ import annotations

import sys

import torch

from helpers import REPO_ROOT, needs_fashion_mnist

sys.path.insert(0, str(REPO_ROOT))

from benchmarks import bench_trainer  # noqa: E402


@needs_fashion_mnist
def test_the_profile_times_each_extra_of_an_update(capsys):
    """--profile ends with the table of what an update does beyond a plain one, each extra timed alone (the
    table called a private method of the Trainer with its old arguments and crashed, unnoticed)."""
    threads = torch.get_num_threads()
    try:
        bench_trainer.main(["--models", "mnist_mlp", "--no-e2e", "--quick", "--profile", "10"])
    finally:
        torch.set_num_threads(threads)  # the benchmark's one thread, not for the tests after this one
    table = capsys.readouterr().out.split("Trainer extras beyond a plain update")[1]
    timed = [line.rsplit(None, 1) for line in table.splitlines() if line.split() and line.split()[-1][:1].isdigit()]
    assert len(timed) == 6 and all(float(us) > 0 for _, us in timed), table

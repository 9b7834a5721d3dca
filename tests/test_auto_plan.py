"""The automatic plan: micro-batches probed against each process's memory budget, precision and backend
chosen from the device, the ``plan |`` table, its checkpoint part and ``--dry-run``.

Budgets on CPU are whole-process resident memory (docs/auto-plan.md): a ``hetfair-train`` rank of the
simulated cluster holds about 300M before its first step, and each sample of ``--sim-hidden 65536`` about
0.9M more, so 420M and 560M leave clearly different room. The cluster runs are real gloo processes of
``benchmarks/simcluster`` (forward passes sleep by each rank's speed: rank 0 is four times slower).
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import REPO_ROOT, final_parameters, run_train
from hetfair.memory.peak import current_bytes
from hetfair.memory.sizes import parse_size
from hetfair.plan.probe import SEARCH_PRECISION, BatchSearch, MicroBatchProbe
from hetfair.plan.state import optimizer_state_ratio

SIMCLUSTER = REPO_ROOT / "benchmarks" / "simcluster"
SEED, LR, TRAIN_SIZE, GLOBAL_BATCH, UPDATES = 5, 0.3, 200, 48, 5
BUDGETS = "420M,560M"


def hetfair_train(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return run_train(args, cwd, timeout=300)


def sim_flags(save_dir: Path, *extra: str) -> list[str]:
    return ["--user-dir", str(SIMCLUSTER), "--task", "sim", "--sim-train-size", str(TRAIN_SIZE),
            "--sim-hidden", "65536", "--sim-speeds", "1,4", "--sim-sample-ms", "1", "--optimizer", "sgd",
            "--lr", str(LR), "--seed", str(SEED), "--global-batch-size", str(GLOBAL_BATCH), "--auto-balance",
            "--save-dir", str(save_dir), "--no-epoch-checkpoints", "--disable-validation", "--log-format", "simple",
            "--distributed-timeout", "60", *extra]


def plan_rows(stderr: str) -> list[dict[str, str]]:
    """The per-rank rows of the ``plan |`` table, by column."""
    lines = [line[len("plan | "):] for line in stderr.splitlines() if line.startswith("plan | ")]
    header = [cell.strip() for cell in lines[0].split(" | ")]
    rows = [[cell.strip() for cell in line.split(" | ")] for line in lines[1:] if line[:1].isdigit()]
    return [dict(zip(header, row)) for row in rows]


def plan_line(stderr: str, start: str) -> str:
    return next(line for line in stderr.splitlines() if line.startswith(start))


def run_auto(tmp_path: Path) -> tuple[subprocess.CompletedProcess, Path]:
    save_dir = tmp_path / "auto"
    result = hetfair_train(tmp_path, *sim_flags(save_dir, "--max-sentences", "auto", "--memory-budget", BUDGETS,
                                                "--precision", "auto", "--ddp-backend", "auto",
                                                "--distributed-world-size", "2", "--max-update", str(UPDATES)))
    assert result.returncode == 0, result.stderr
    return result, save_dir


def test_budgets_give_their_own_micro_batches_and_train_as_the_hand_written_command(tmp_path):
    auto, auto_dir = run_auto(tmp_path)
    rows = plan_rows(auto.stderr)
    small, large = (int(row["micro-batch"]) for row in rows)
    assert 1 <= small < large and [row["budget"] for row in rows] == ["420.0M", "560.0M"]
    assert [row["precision"] for row in rows] == ["fp32", "fp32"]  # --precision auto on CPU
    assert all(row["why"].startswith("probed: ") for row in rows)
    assert plan_line(auto.stderr, "plan | --ddp-backend ").startswith("plan | --ddp-backend c10d: every rank holds")
    rate = r"[\d,]+\.\d samples/s \(efficiency \d\.\d\d\)"
    assert re.fullmatch(rf"plan \| predicted \(1 sample a rank per update, on the measured devices and link\): "
                        rf"c10d {rate}; runner-up fully_sharded {rate}", plan_line(auto.stderr, "plan | predicted "))
    hand_dir = tmp_path / "hand"
    hand = hetfair_train(tmp_path, *sim_flags(hand_dir, "--max-sentences", f"{small},{large}",
                                              "--distributed-world-size", "2", "--max-update", str(UPDATES)))
    assert hand.returncode == 0, hand.stderr
    assert "plan | " not in hand.stderr  # nothing automatic: no table
    expected, actual = final_parameters(hand_dir), final_parameters(auto_dir)
    assert actual.keys() == expected.keys()
    for name in expected:  # the same updates, their samples split otherwise: float summation order only
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-4, atol=1e-5, msg=name)
    saved = torch.load(auto_dir / "checkpoint_last.pt", map_location="cpu", weights_only=True)["plan"]
    assert saved["micro_batches"] == [small, large] and saved["backend"] == "c10d" and saved["world_size"] == 2

    # an elastic resize: the same command on one process probes again and says what changed
    shutil.copytree(auto_dir, tmp_path / "resized")
    resized = hetfair_train(tmp_path, *sim_flags(tmp_path / "resized", "--max-sentences", "auto",
                                                 "--memory-budget", "560M", "--ddp-backend", "auto",
                                                 "--max-update", str(UPDATES + 1)))
    assert resized.returncode == 0, resized.stderr
    changed = plan_line(resized.stderr, "plan | the plan changed since the checkpoint: ")
    assert "world size 2 -> 1" in changed and f"micro-batches [{small}, {large}] -> " in changed
    assert len(plan_rows(resized.stderr)) == 1


def test_auto_backend_shards_a_model_whose_state_fits_no_rank(tmp_path):
    # 113M of parameters (P) in three 38M sharding units (U), Adam's two moments (O = 2P), about 300M before
    # the first step: replicated needs 300M + P + P + O = 750M per process, sharded in halves
    # 300M + P + P + O/2 + 2U - P = 600M; equal budgets of 680M. Replicated (the default backend), not one sample
    # fits: the error says to shard, and the command that does trains.
    flags = ["--user-dir", str(SIMCLUSTER), "--task", "sim", "--sim-train-size", "16", "--sim-hidden", "3072",
             "--sim-layers", "3", "--sim-speeds", "1,1", "--sim-sample-ms", "0", "--max-sentences", "auto",
             "--distributed-world-size", "2", "--max-update", "1", "--no-save", "--disable-validation",
             "--log-format", "simple", "--distributed-timeout", "60"]
    replicated = hetfair_train(tmp_path, *flags, "--memory-budget", "680M")
    assert replicated.returncode == 2 and "cannot train even one sample" in replicated.stderr, replicated.stderr
    assert "shard the state (--ddp-backend auto)" in replicated.stderr
    assert "out of the job" not in replicated.stderr  # both ranks are short: leaving them out leaves nothing
    result = hetfair_train(tmp_path, *flags, "--memory-budget", "680M", "--ddp-backend", "auto")
    assert result.returncode == 0, result.stderr
    assert plan_line(result.stderr, "plan | --ddp-backend ").startswith(
        "plan | --ddp-backend fully_sharded: rank(s) 0, 1 cannot hold the model's state")
    assert [row["shard"] for row in plan_rows(result.stderr)] == ["0.50", "0.50"]
    assert "plan | predicted" not in result.stderr  # no choice to rank: only sharding fits
    assert "num_updates 1" in result.stderr  # trained on the sharded backend
    # sharded already and still short of one sample: the error no longer offers sharding
    sharded = hetfair_train(tmp_path, *flags, "--memory-budget", "450M", "--ddp-backend", "auto")
    assert sharded.returncode == 2 and "cannot train even one sample" in sharded.stderr, sharded.stderr
    assert "--ddp-backend" not in sharded.stderr


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path):
    save_dir, logdir = tmp_path / "checkpoints", tmp_path / "tensorboard"
    result = hetfair_train(tmp_path, *sim_flags(save_dir, "--max-sentences", "auto", "--memory-budget", "2G",
                                                "--max-update", "3", "--tensorboard-logdir", str(logdir),
                                                "--dry-run"))
    assert result.returncode == 0, result.stderr
    assert plan_rows(result.stderr)[0]["micro-batch"] == str(TRAIN_SIZE)  # 2G holds the whole training set
    assert "dry run | " in result.stderr and "train_inner" not in result.stderr and "done |" not in result.stderr
    assert sorted(tmp_path.iterdir()) == []  # no checkpoint directory, no TensorBoard files


def test_a_budget_too_small_for_one_sample_is_one_error_line_whose_remedies_each_make_a_plan(tmp_path):
    """Rank 0's 64M is below what its process holds before any step (measured and said): sharding cannot
    help, so it is not offered; the budget the error names, and leaving rank 0 out, each make a plan."""
    flags = sim_flags(tmp_path / "ckpt", "--max-sentences", "auto", "--max-update", "1")
    result = hetfair_train(tmp_path, *flags, "--memory-budget", "64M,2G", "--distributed-world-size", "2")
    error = result.stderr
    assert result.returncode == 2 and error.count("\n") == 1, error
    assert error.startswith("hetfair-train: error: rank 0 (cpu) cannot train even one sample within its memory "
                            "budget 64.0M"), error  # the job's error: no "[rank 1]" of the rank that reported it
    held = re.search(r"the process held ([\d.]+[KMG]) before any step, measured", error)
    assert held and parse_size(held[1]) > parse_size("64M"), error
    assert "--ddp-backend" not in error
    budget = re.search(r"give rank\(s\) 0 a --memory-budget of at least ([\d.]+[KMG])", error)
    assert budget and "or leave rank(s) 0 out of the job" in error, error
    for fix in (["--memory-budget", f"{budget[1]},2G", "--distributed-world-size", "2"], ["--memory-budget", "2G"]):
        followed = hetfair_train(tmp_path, *flags, *fix, "--dry-run")
        assert followed.returncode == 0 and "dry run | " in followed.stderr, (fix, followed.stderr)


def test_auto_on_cpu_without_a_budget_is_one_error_line(tmp_path):
    result = hetfair_train(tmp_path, *sim_flags(tmp_path / "ckpt", "--max-sentences", "auto", "--max-update", "1"))
    assert result.returncode != 0 and result.stderr.count("\n") == 1, result.stderr
    assert "--max-sentences auto on CPU needs --memory-budget SIZE" in result.stderr


class _Normed(nn.Module):
    """A model with a buffer a forward pass changes (batch-norm statistics) and a random op (dropout)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 4096), nn.Unflatten(1, (4, 1024)), nn.BatchNorm1d(4), nn.Dropout(0.5),
                                 nn.Flatten(), nn.Linear(4096, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _criterion(model: nn.Module, batch: dict) -> tuple[torch.Tensor, int, dict]:
    return model(batch["x"]).sum(), len(batch["x"]), {}


def test_probing_leaves_parameters_buffers_and_generators_as_they_were():
    torch.manual_seed(0)
    model = _Normed()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    rng = torch.get_rng_state()
    probe = MicroBatchProbe(model, _criterion, lambda n: {"x": torch.randn(n, 8)}, torch.device("cpu"), "fp32",
                            budget=current_bytes(torch.device("cpu")) + (64 << 20))
    result = probe.largest(upper=100_000, reserve=0)
    assert 2 <= result.largest < 100_000  # 64M of room: thousands of 16K samples, not 100,000
    assert result.steps <= math.ceil(math.log2(100_000)) + 1 + 2 * math.ceil(math.log2(1 / SEARCH_PRECISION))
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_optimizer_state_is_measured_per_parameter_byte():
    assert optimizer_state_ratio(lambda params: torch.optim.Adam(params)) == 2.0  # two moments
    assert optimizer_state_ratio(lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)) == 1.0
    assert optimizer_state_ratio(lambda params: torch.optim.SGD(params, lr=0.1)) == 0.0


@pytest.mark.parametrize("per_sample, exponent", [(200_000, 1.0), (40_000, 1.3), (2_000_000, 0.7), (3, 1.0)])
def test_the_search_finds_the_largest_batch_within_its_precision_in_few_steps(per_sample, exponent):
    """Against the brute-force answer on memory curves linear and not: the search's ``low`` fits, its ``high``
    does not and is within SEARCH_PRECISION of it, no step asks for more than twice what fitted, and the steps
    stay within the stated bound (for a linear curve: two after the doubling)."""
    base, budget, upper = 300_000_000, 456_000_000, 100_000

    def peak(samples: int) -> int:
        return base + int(per_sample * samples ** exponent)

    answer = max(n for n in range(1, upper + 1) if peak(n) <= budget)
    search, asked = BatchSearch(upper, budget, peak(1)), [1]
    while (candidate := search.next_candidate()) is not None:
        assert candidate <= 2 * search.low
        asked.append(candidate)
        search.record(candidate, peak(candidate) <= budget, peak(candidate))
    assert peak(search.low) <= budget and search.low <= answer
    if answer == upper:
        assert search.low == upper and search.high is None
    else:
        assert peak(search.high) > budget and search.high - search.low <= math.ceil(search.low * SEARCH_PRECISION)
    doubling = math.ceil(math.log2(min(upper, 2 * answer))) + 1
    assert len(asked) <= doubling + 2 * math.ceil(math.log2(1 / SEARCH_PRECISION)), asked
    if exponent == 1.0 and answer < upper:
        assert len(asked) <= doubling + 2, asked

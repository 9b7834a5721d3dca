"""Memory budgets: the shares of the state they give, the fit check at start-up, the memory | table.

The multi-process tests run real gloo groups of hetfair-train; the numbers they check
are the model's own sizes (its parameter count times the bytes per parameter).
"""

from __future__ import annotations

import re
import subprocess
from argparse import Namespace
from pathlib import Path

import pytest

from helpers import REPO_ROOT, TOY_PLUGIN, run_nodes
from hetfair.errors import ConfigError
from hetfair.memory.sizes import parse_size
from hetfair.memory.plan import StateSize, check_fit, complete_parallel_config
from hetfair.plan.state import optimizer_state_ratio
from hetfair.optim import OPTIMIZER_REGISTRY
from hetfair.parallel import ParallelConfig

SHARDED = ParallelConfig("fully_sharded")
G = 1 << 30
SIMCLUSTER = REPO_ROOT / "benchmarks" / "simcluster"


def complete(config: ParallelConfig, budgets: list, measured: list | None = None) -> tuple[ParallelConfig, list[str]]:
    notices: list[str] = []
    done = complete_parallel_config(config, budgets, measured or [False] * len(budgets), notices.append)
    return done, notices


def test_budgets_give_a_sharded_mode_its_fractions():
    assert complete(SHARDED, [6 * G, 18 * G]) == (ParallelConfig("fully_sharded", shard_fractions=(0.25, 0.75)), [])


def test_shard_fractions_given_win_over_budgets():
    config = ParallelConfig("fully_sharded", shard_fractions=(0.5, 0.5))
    assert complete(config, [6 * G, 18 * G]) == (config, [])


def test_budgets_give_zero_1_its_shard_weights_unless_given():
    zero = ParallelConfig("c10d", zero_sharding="os")
    assert complete(zero, [6 * G, 18 * G])[0].zero_shard_weights == f"{6 * G},{18 * G}"
    given = ParallelConfig("c10d", zero_sharding="os", zero_shard_weights="1,1")
    assert complete(given, [6 * G, 18 * G])[0] == given


def test_modes_without_shards_ignore_budgets():
    assert complete(ParallelConfig("c10d"), [6 * G, 18 * G]) == (ParallelConfig("c10d"), [])
    assert complete(ParallelConfig("hybrid_sharded"), [6 * G, 18 * G]) == (ParallelConfig("hybrid_sharded"), [])


def test_some_ranks_without_a_budget_split_evenly_and_say_so_in_one_line():
    done, notices = complete(SHARDED, [6 * G, None, 18 * G])
    assert done == SHARDED and len(notices) == 1 and "ranks 1 have no --memory-budget" in notices[0]


def test_measured_budgets_of_alike_devices_keep_equal_shards():
    """Free memory measured on two alike GPUs differs by a few MiB: that must not move the shards."""
    assert complete(SHARDED, [40 * G, 40 * G - (5 << 20)], [True, True])[0] == SHARDED
    assert complete(SHARDED, [20 * G, 70 * G], [True, True])[0].shard_fractions == (20 / 90, 70 / 90)


@pytest.mark.parametrize("optimizer, flags, ratio", [("adam", {}, 2.0), ("sgd", {"momentum": 0.0}, 0.0),
                                                     ("sgd", {"momentum": 0.9}, 1.0)])
def test_optimizer_state_per_parameter_byte(optimizer, flags, ratio):
    args = Namespace(lr=0.1, weight_decay=0.0, adam_betas="(0.9, 0.999)", adam_eps=1e-8, nesterov=False, **flags)
    recipe = OPTIMIZER_REGISTRY.get(optimizer)
    assert optimizer_state_ratio(lambda params: recipe.torch_class(params, **recipe.torch_kwargs(args))) == ratio


def test_a_rank_whose_share_does_not_fit_is_one_line_naming_it_and_a_share_that_fits():
    size = StateSize(param_bytes=1000 << 20, optimizer_ratio=2.0, largest_unit_bytes=100 << 20)  # 4000M of state
    check_fit(size, [(0.25, 0.25), (0.75, 0.75)], [1200 << 20, 3200 << 20], takes_fractions=True)  # 1000M + 100M fit
    with pytest.raises(ConfigError) as error:
        check_fit(size, [(0.5, 0.5), (0.5, 0.5)], [1200 << 20, None], takes_fractions=True)
    message = str(error.value)
    assert "\n" not in message and message.startswith("rank 0 would hold 2.0G of training state")
    share = float(re.search(r"--shard-fractions ([\d.]+),", message).group(1))
    assert size.of_rank((share, share)) + size.largest_unit_bytes <= 1200 << 20  # the suggestion fits
    with pytest.raises(ConfigError, match="shard the state with --ddp-backend fully_sharded"):
        check_fit(size, [(1.0, 1.0), (1.0, 1.0)], [1200 << 20, None], takes_fractions=False)
    with pytest.raises(ConfigError, match=r"or --offload 1 on rank 0 \(a GPU rank"):
        check_fit(size, [(1.0, 1.0), (1.0, 1.0)], [1200 << 20, None], takes_fractions=False, can_offload=True)


# -- real runs ---------------------------------------------------------------------------------------
HIDDEN = 1024
PARAMS = 8 * HIDDEN + HIDDEN + HIDDEN * 3 + 3  # blobs_mlp: Linear(8, H), Linear(H, 3)
FULL_STATE = PARAMS * 4 * (1 + 1 + 2)  # fp32 parameters, gradients and Adam's two moments


def sharded_toy(tmp_path: Path, *flags: str) -> list[str]:
    return ["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--optimizer", "adam", "--lr", "0.01", "--max-update",
            "1", "--max-epoch", "0", "--save-dir", str(tmp_path / "ckpt"), "--no-save", "--log-format", "simple",
            "--disable-validation", "--distributed-world-size", "2", "--max-sentences", "8,24", "--ddp-backend",
            "fully_sharded", "--toy-units", "--toy-hidden", str(HIDDEN), "--distributed-timeout", "60", *flags]


def rounding(printed: str) -> float:
    """How far a size printed with one decimal (``2.7G``) may be from the bytes it stands for."""
    return 0.05 * parse_size("1" + printed[-1]) if printed[-1] in "KMGT" else 0.5


def memory_rows(output: str) -> list[list[str]]:
    lines = [line for line in output.splitlines() if re.match(r"memory \| \d", line)]
    return [[cell.strip() for cell in line.split("|")[1:]] for line in lines]


def test_budgets_shard_the_state_and_the_memory_table_shows_it_and_warns_a_rank_past_its_budget(tmp_path):
    """Budgets of 100M and 3G give rank 0 100/3172 of the state (no --shard-fractions); its budget holds that
    share but not the interpreter's resident memory: the table, then one warning."""
    result, = run_nodes([sharded_toy(tmp_path, "--memory-budget", "100M,3G")], tmp_path)
    assert result.returncode == 0, result.stderr
    rows = memory_rows(result.stderr)  # the progress lines
    assert [row[0] for row in rows] == ["0", "1"] and [row[1] for row in rows] == ["100.0M", "3.0G"]
    budgets = [parse_size("100M"), parse_size("3G")]
    for row, budget in zip(rows, budgets):
        share = budget / sum(budgets) * FULL_STATE
        state = parse_size(row[2].split(":")[0])
        assert share / 1.1 <= state <= 1.1 * share, row  # its fraction of the state, rounding aside
        unit = parse_size(row[3])
        assert abs(unit - 4 * (HIDDEN * 8 + HIDDEN)) <= 0.05 * unit, row  # the first Linear, whole
        peak, headroom = parse_size(row[5]), parse_size(row[6].lstrip("-")) * (-1 if row[6][0] == "-" else 1)
        assert abs(budget - peak - headroom) <= rounding(row[5]) + rounding(row[6]), row
    setup = re.search(r"setup \| .* \| parameters (\d+) \| rank0_parameters (\d+) \|", result.stderr)
    assert setup and int(setup[1]) == PARAMS, result.stderr  # the whole model's, not rank 0's shard
    assert abs(int(setup[2]) - budgets[0] / sum(budgets) * PARAMS) <= 0.1 * int(setup[2])  # labelled: rank 0's
    warnings = [line for line in result.stderr.splitlines() if line.startswith("memory | warning")]
    assert len(warnings) == 1 and "rank 0's first update peaked at" in warnings[0], result.stderr
    held = re.search(r"its process held ([\d.]+[KMG]) before that update \(measured", warnings[0])
    assert held and parse_size(held[1]) > budgets[0], warnings[0]  # 100M is below the interpreter's memory
    assert "--activation-checkpointing" not in warnings[0] and "--shard-fractions" not in warnings[0]  # no help


def test_a_replicated_plan_that_cannot_fit_is_told_to_shard_and_the_sharded_command_trains(tmp_path):
    replicated = [arg for arg in sharded_toy(tmp_path, "--memory-budget", "150K,1G")
                  if arg not in ("--ddp-backend", "fully_sharded")]  # the default backend: c10d
    result, = run_nodes([replicated], tmp_path)
    [error] = result.stderr.strip().splitlines()
    assert result.returncode == 2 and error.endswith("; shard the state with --ddp-backend fully_sharded"), error
    followed, = run_nodes([[*replicated, "--ddp-backend", "fully_sharded"]], tmp_path)
    assert followed.returncode == 0 and "num_updates 1" in followed.stderr, followed.stderr


def sim_over_budget(tmp_path: Path, max_sentences: str, budgets: str, *extra: str) -> subprocess.CompletedProcess:
    """Two replicated ranks of the simulated cluster's model (no sharding units), 0.75M of activations a sample."""
    result, = run_nodes([["--user-dir", str(SIMCLUSTER), "--task", "sim", "--sim-hidden", "65536", "--sim-speeds",
                          "1,1", "--sim-sample-ms", "0", "--sim-train-size", "400", "--optimizer", "sgd", "--lr",
                          "0.3", "--no-save", "--disable-validation", "--log-format", "simple", "--max-update", "1",
                          "--distributed-world-size", "2", "--distributed-timeout", "60", "--max-sentences",
                          max_sentences, "--memory-budget", budgets, *extra]], tmp_path)  # later flags win
    assert result.returncode == 0, result.stderr
    return result


def test_each_remedy_the_over_budget_warning_offers_brings_the_rank_under_its_budget(tmp_path):
    """400M holds the process (about 300M) but not 200 samples' activations: the warning offers a smaller
    micro-batch and a larger budget, not activation checkpointing (the model has no sharding units) nor a
    smaller share of the state (6M of it cannot save 70M); each offer, run, leaves rank 0 under its budget."""
    warned = sim_over_budget(tmp_path, "200,200", "400M,2G").stderr
    (warning,) = [line for line in warned.splitlines() if line.startswith("memory | warning: rank 0's")]
    assert "--activation-checkpointing" not in warning and "--shard-fractions" not in warning, warning
    micro_batch = re.search(r"at most --max-sentences (\d+) on rank 0", warning)
    budget = re.search(r"--memory-budget ([\d.]+[KMG]) for rank 0", warning)
    assert micro_batch and budget, warning
    for flags in ((f"{micro_batch[1]},200", "400M,2G"), ("200,200", f"{budget[1]},2G")):
        followed = sim_over_budget(tmp_path, *flags).stderr
        assert "memory | warning" not in followed and "memory | 0 " in followed, (flags, followed)


def test_a_plan_that_cannot_fit_fails_at_start_up_in_one_line(tmp_path):
    result, = run_nodes([sharded_toy(tmp_path, "--memory-budget", "40K,1G", "--shard-fractions", "1,1")], tmp_path)
    errors = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(errors) == 1, result.stderr
    assert errors[0].startswith("hetfair-train: error: rank 0 would hold"), errors[0]  # the job's: no "[rank 1]"
    assert "more than its memory budget 40.0K" in errors[0]
    assert "memory |" not in result.stderr  # no update ran
    assert "--offload" not in errors[0]  # CPU ranks: offloading moves GPU state to host memory, nothing here
    fractions = re.search(r"--shard-fractions ([\d.]+,[\d.]+)", errors[0])
    assert fractions, errors[0]
    followed, = run_nodes([sharded_toy(tmp_path, "--memory-budget", "40K,1G", "--shard-fractions", fractions[1])],
                          tmp_path)
    assert followed.returncode == 0 and "num_updates 1" in followed.stderr, followed.stderr


def test_a_rank_of_a_sharded_run_is_not_told_to_checkpoint_activations_alone(tmp_path):
    """Fully sharded, one hidden layer (a sharding unit): recomputing a gathered unit on rank 0 only would mismatch
    the ranks' gathers (gloo aborts the job), so the warning leaves --activation-checkpointing out."""
    warned = sim_over_budget(tmp_path, "200,200", "500M,2G", "--ddp-backend", "fully_sharded", "--sim-layers", "1",
                             "--sim-hidden", "4096").stderr
    (warning,) = [line for line in warned.splitlines() if line.startswith("memory | warning: rank 0's")]
    assert "--activation-checkpointing" not in warning and "--max-sentences" in warning, warning


def test_a_replicated_rank_is_not_told_to_give_its_state_to_others(tmp_path):
    """Replicated, every rank holds the whole state (256M here, more than rank 0 went over its budget by): no
    --shard-fractions or budget of the others changes that, so the warning does not offer them."""
    warned = sim_over_budget(tmp_path, "200,200", "500M,2G", "--sim-layers", "2", "--sim-hidden", "4096").stderr
    (warning,) = [line for line in warned.splitlines() if line.startswith("memory | warning: rank 0's")]
    assert "--shard-fractions" not in warning and "--memory-budget" in warning, warning

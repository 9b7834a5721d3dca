"""Automatic load balancing: the split follows the ranks' speeds, and the math does not change.

Policy tests feed :class:`LoadBalancer` synthetic timings (pure Python). The
cluster tests run real gloo processes of the simulated cluster in
``benchmarks/simcluster`` (forward passes sleep in proportion to batch size over
each rank's speed) and check the probed start, the split, the caps, resume and the
final parameters against a plain PyTorch loop over the same global batches.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from argparse import Namespace
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetfair.balance import BalanceConfig, LoadBalancer, probe_samples
from hetfair.logging.meters import IntervalStats
from hetfair.parallel.stats import UpdateResult
from hetfair_cli.train import main
from helpers import REPO_ROOT, TOY_PLUGIN, free_port, rank_flags, run_nodes

SIMCLUSTER = REPO_ROOT / "benchmarks" / "simcluster"


# -- the policy -------------------------------------------------------------------------
def drive(balancer: LoadBalancer, cost, updates: int) -> list[tuple[int, list[int]]]:
    """Run ``updates`` updates where rank r's compute time for n samples is ``cost(update, r, n)``."""
    resplits = []
    for update in range(1, updates + 1):
        split = list(balancer.split)
        seconds = [cost(update, rank, n) for rank, n in enumerate(split)]
        new = balancer.observe(split, seconds)
        if new is not None:
            resplits.append((update, new))
    return resplits


def linear(per_sample: Sequence[float], overhead: Sequence[float] = (0, 0, 0, 0)):
    return lambda update, rank, n: overhead[rank] + n * per_sample[rank]


SPEEDS_1124 = [1.0, 1.0, 0.5, 0.25]  # seconds per sample of ranks with speeds 1:1:2:4
CONFIG = BalanceConfig(warmup_updates=2, interval=5, smoothing=0.3, threshold=0.03)


def test_split_follows_the_speed_ratio():
    balancer = LoadBalancer([64] * 4, 64, CONFIG)
    assert balancer.split == [16, 16, 16, 16]
    resplits = drive(balancer, linear(SPEEDS_1124), 30)
    assert resplits == [(7, [8, 8, 16, 32])]  # 64 samples in proportion 1:1:2:4, decided once


def test_caps_stay_hard_maxima():
    balancer = LoadBalancer([64, 64, 64, 16], 64, CONFIG)
    drive(balancer, linear(SPEEDS_1124), 30)
    # rank 3 would take 32 but holds 16; the other 48 go 1:1:2
    assert balancer.split == [12, 12, 24, 16]


def test_nothing_moves_before_warmup_and_one_interval():
    balancer = LoadBalancer([64] * 4, 64, BalanceConfig(warmup_updates=4, interval=3, smoothing=1.0, threshold=0.0))
    resplits = drive(balancer, linear(SPEEDS_1124), 7)
    assert resplits == [(7, [8, 8, 16, 32])]


def test_fixed_overhead_converges_to_equal_step_times():
    # rank 3 pays 8 s per step whatever its batch: equal times need T + T + 2T + 4(T - 8) = 64, T = 12
    balancer = LoadBalancer([64] * 4, 64, CONFIG)
    resplits = drive(balancer, linear(SPEEDS_1124, overhead=(0, 0, 0, 8)), 100)
    assert balancer.split == [12, 12, 24, 16]
    assert len(resplits) <= 6 and resplits[-1][0] <= 40


def noisy(per_sample: Sequence[float], noise: float):
    """Linear costs times a reproducible random factor in ``1 +- noise``, drawn per update and rank."""
    return lambda update, rank, n: n * per_sample[rank] * (1 + noise * random.Random(update * 7 + rank).uniform(-1, 1))


def test_hysteresis_ignores_noise_below_the_threshold():
    balanced = {"split": [8, 8, 16, 32], "resplits": 0, "measured": 0, "samples": [0.0] * 4, "seconds": [0.0] * 4}
    steady = LoadBalancer([64] * 4, 64, BalanceConfig(2, 5, 0.3, threshold=0.05))
    assert steady.load_state_dict(balanced)
    assert drive(steady, noisy(SPEEDS_1124, 0.1), 400) == []
    eager = LoadBalancer([64] * 4, 64, BalanceConfig(2, 5, 0.3, threshold=0.0))
    assert eager.load_state_dict(balanced)
    assert len(drive(eager, noisy(SPEEDS_1124, 0.1), 400)) > 5  # the same noise churns without hysteresis


def test_a_slowed_rank_is_rebalanced_within_two_intervals():
    balancer = LoadBalancer([64] * 4, 64, CONFIG)

    def cost(update: int, rank: int, n: int) -> float:
        slow_down = 4.0 if rank == 3 and update > 20 else 1.0  # rank 3 drops from speed 4 to 1
        return n * SPEEDS_1124[rank] * slow_down

    resplits = drive(balancer, cost, 40)
    assert resplits[0] == (7, [8, 8, 16, 32])
    later = [(update, split) for update, split in resplits if update > 20]
    # 64 in proportion 1:1:2:1 is 12.8, 12.8, 25.6, 12.8; the 3 left over go to the largest remainders
    assert later and later[-1][1] == [13, 13, 25, 13]
    assert later[-1][0] <= 20 + 2 * CONFIG.interval


def test_every_rank_keeps_a_sample_to_stay_measured():
    balancer = LoadBalancer([8, 64], 8, CONFIG)
    drive(balancer, linear([1000.0, 0.001]), 20)
    assert balancer.split == [1, 7]


def test_restored_balancer_decides_like_the_original():
    config = BalanceConfig(warmup_updates=0, interval=5, smoothing=0.3, threshold=0.03)  # warm-up is per process
    original = LoadBalancer([64] * 4, 64, config)
    drive(original, linear(SPEEDS_1124), 7)  # re-split at 5, two measurements since
    restored = LoadBalancer([64] * 4, 64, config)
    assert restored.load_state_dict(json.loads(json.dumps(original.state_dict())))  # plain data
    assert restored.split == original.split == [8, 8, 16, 32]
    slower = linear([1.0, 1.0, 0.5, 1.0])
    assert drive(restored, slower, 20) == drive(original, slower, 20) != []


@pytest.mark.parametrize("caps, global_batch", [([64] * 3, 64), ([64, 64, 64, 16], 64), ([64] * 4, 48)])
def test_a_saved_split_that_does_not_fit_is_refused(caps, global_batch):
    saved = LoadBalancer([64] * 4, 64, CONFIG)
    drive(saved, linear(SPEEDS_1124), 10)  # [8, 8, 16, 32]
    fresh = LoadBalancer(caps, global_batch, CONFIG)
    initial = list(fresh.split)
    assert not fresh.load_state_dict(saved.state_dict())
    assert fresh.split == initial


@pytest.mark.parametrize("caps, global_batch, speeds, split", [
    ([64] * 4, 128, [25.0, 25.0, 50.0, 100.0], [16, 16, 32, 64]),  # 128 in proportion 1:1:2:4
    ([64, 64, 64, 40], 128, [25.0, 25.0, 50.0, 100.0], [22, 22, 44, 40]),  # rank 3 capped, 88 go 1:1:2
    ([64] * 3, 10, [3.0, 1.0, 1.0], [6, 2, 2]),
    ([16, 64], 16, [0.001, 1000.0], [1, 15]),  # every rank keeps a sample
])
def test_a_start_from_speeds_splits_in_proportion_under_caps(caps, global_batch, speeds, split):
    assert LoadBalancer(caps, global_batch, default_config(), speeds).split == split
    assert LoadBalancer(caps, global_batch, default_config()).split != split  # the batch sizes' start differs


def test_probe_steps_are_an_eighth_of_the_share_and_at_least_one_sample():
    assert [probe_samples(share) for share in (1, 7, 8, 9, 32, 33)] == [1, 1, 1, 2, 4, 5]


# -- the default tuning reacts within a few updates ------------------------------------------
def default_args() -> Namespace:
    """The ``--balance-*`` defaults of ``hetfair-train``."""
    from hetfair.options import build_parser

    parser = build_parser()
    names = ("start", "warmup_updates", "interval", "smoothing", "threshold")
    return Namespace(**{f"balance_{n}": parser.get_default(f"balance_{n}") for n in names})


def default_config() -> BalanceConfig:
    """The tuning ``hetfair-train --auto-balance`` uses by default (timings on time)."""
    return BalanceConfig.from_args(default_args())


IDEAL_1124 = [16, 16, 32, 64]  # 128 samples in proportion 1:1:2:4


def test_defaults_resplit_within_five_measured_updates():
    config = default_config()
    balancer = LoadBalancer([64] * 4, 128, config)
    resplits = drive(balancer, linear(SPEEDS_1124), 60)
    assert resplits == [(resplits[0][0], IDEAL_1124)] and resplits[0][0] - config.warmup_updates <= 5


def test_per_step_overheads_converge_in_two_resplits():
    overhead = (6.0, 0.0, 3.0, 0.0)
    balancer = LoadBalancer([96] * 4, 128, default_config())  # no cap binds
    resplits = drive(balancer, linear(SPEEDS_1124, overhead), 100)
    assert 1 <= len(resplits) <= 2 and resplits[-1][0] <= 12
    times = [overhead[r] + n * SPEEDS_1124[r] for r, n in enumerate(balancer.split)]
    assert max(times) - min(times) <= max(SPEEDS_1124)  # equal step times, up to one sample


def drive_late(balancer: LoadBalancer, cost, updates: int) -> list[tuple[int, list[int]]]:
    """:func:`drive` as the trainer feeds the balancer: each update brings the previous update's timings."""
    resplits, previous = [], ([], [])
    for update in range(1, updates + 1):
        split = list(balancer.split)  # this update's; a re-split after it applies from the next
        new = balancer.observe(*previous)
        previous = (split, [cost(update, rank, n) for rank, n in enumerate(split)])
        if new is not None:
            resplits.append((update, new))
    return resplits


def test_late_timings_with_lag_reach_the_same_splits_one_update_later():
    overhead = (6.0, 0.0, 3.0, 0.0)
    late_config = BalanceConfig.from_args(default_args(), lag=1)
    on_time = drive(LoadBalancer([96] * 4, 128, default_config()), linear(SPEEDS_1124, overhead), 100)
    late = drive_late(LoadBalancer([96] * 4, 128, late_config), linear(SPEEDS_1124, overhead), 100)
    assert len(on_time) == 2 and [split for _, split in late] == [split for _, split in on_time]
    # one update for the late arrival, one for the dropped observation of the old split after the first re-split
    assert [update for update, _ in late] == [on_time[0][0] + 1, on_time[1][0] + 2]


PROBED_OFF = [25.0, 25.0, 50.0, 75.0]  # a probe that saw rank 3 at speed 3 (small steps weigh its overhead)


def test_a_probed_start_decides_after_one_measured_update():
    from_batch_sizes = drive(LoadBalancer([64] * 4, 128, default_config()), linear(SPEEDS_1124), 60)
    from_speeds = drive(LoadBalancer([64] * 4, 128, default_config(), PROBED_OFF), linear(SPEEDS_1124), 60)
    assert from_batch_sizes == [(3, IDEAL_1124)]  # warm-up 1, then 2 measured updates
    assert from_speeds == [(2, IDEAL_1124)]  # warm-up 1, then 1
    late = LoadBalancer([64] * 4, 128, BalanceConfig.from_args(default_args(), lag=1), PROBED_OFF)
    assert drive_late(late, linear(SPEEDS_1124), 60) == [(3, IDEAL_1124)]  # as the trainer feeds it


def test_a_probed_start_at_balance_holds_under_noise():
    balancer = LoadBalancer([64] * 4, 128, default_config(), [25.0, 25.0, 50.0, 100.0])
    assert balancer.split == IDEAL_1124
    resplits = drive(balancer, noisy(SPEEDS_1124, 0.1), 400)  # as test_noisy_timings_do_not_oscillate
    assert len(resplits) <= 5 and resplits[-1][0] <= 40
    assert all(abs(n - ideal) <= 1 for n, ideal in zip(balancer.split, IDEAL_1124))


def test_a_restored_probed_start_still_decides_after_one_measured_update():
    original = LoadBalancer([64] * 4, 128, default_config(), PROBED_OFF)
    drive(original, linear(SPEEDS_1124), 1)  # the warm-up: no decision yet
    restored = LoadBalancer([64] * 4, 128, replace(default_config(), warmup_updates=0))
    assert restored.load_state_dict(json.loads(json.dumps(original.state_dict())))
    assert drive(restored, linear(SPEEDS_1124), 30) == [(1, IDEAL_1124)]


def test_an_update_without_timings_is_not_measured():
    balancer = LoadBalancer([64] * 4, 64, CONFIG)
    assert balancer.observe([], []) is None
    assert drive(balancer, linear(SPEEDS_1124), 30) == [(7, [8, 8, 16, 32])]  # as if it never came


@pytest.mark.parametrize("overhead", [(0.0, 0.0, 0.0, 0.0), (3.0, 3.0, 3.0, 3.0)])
def test_a_slowed_rank_is_rebalanced_within_ten_updates(overhead):
    def cost(update: int, rank: int, n: int) -> float:
        slow_down = 4.0 if rank == 3 and update > 20 else 1.0  # rank 3 drops from speed 4 to 1
        return overhead[rank] + n * SPEEDS_1124[rank] * slow_down

    balancer = LoadBalancer([64] * 4, 128, default_config())
    later = [(update, split) for update, split in drive(balancer, cost, 80) if update > 20]
    assert later and later[-1][0] <= 30
    times = [overhead[r] + n * SPEEDS_1124[r] * (4.0 if r == 3 else 1.0) for r, n in enumerate(balancer.split)]
    assert max(times) - min(times) <= 1.0  # 1 s: one sample of the slowest rank


def test_noisy_timings_do_not_oscillate():
    balancer = LoadBalancer([64] * 4, 128, default_config())
    resplits = drive(balancer, noisy(SPEEDS_1124, 0.1), 400)
    assert len(resplits) <= 5 and resplits[-1][0] <= 40  # settles early, then holds for 360 updates
    assert all(abs(n - ideal) <= 1 for n, ideal in zip(balancer.split, IDEAL_1124))


def test_a_single_slow_step_does_not_move_a_balanced_split():
    def cost(update: int, rank: int, n: int) -> float:
        return n * SPEEDS_1124[rank] * (3.0 if (update, rank) in {(30, 0), (45, 3), (60, 2)} else 1.0)

    balancer = LoadBalancer([64] * 4, 128, default_config())
    resplits = drive(balancer, cost, 100)
    assert len(resplits) == 1 and resplits[0][1] == IDEAL_1124


def test_restored_default_balancer_decides_like_the_original():
    def cost(update: int, rank: int, n: int) -> float:
        slow_down = 4.0 if rank == 3 and update > 12 else 1.0
        return (2.0 if rank == 0 else 0.0) + n * SPEEDS_1124[rank] * slow_down

    for stop in (2, 4, 7, 13, 14):  # mid-interval, after the fit, while a speed change is being confirmed
        original = LoadBalancer([64] * 4, 128, default_config())
        drive(original, cost, stop)
        restored = LoadBalancer([64] * 4, 128, replace(default_config(), warmup_updates=0))
        assert restored.load_state_dict(json.loads(json.dumps(original.state_dict())))
        assert original.split == restored.split

        def later(update: int, rank: int, n: int) -> float:
            return cost(update + stop, rank, n)

        assert drive(restored, later, 30) == drive(original, later, 30)


def update_result(samples: list[float], seconds: list[float]) -> UpdateResult:
    return UpdateResult(totals={}, samples=samples, timed_samples=samples, compute_seconds=seconds, lr=0.1, gnorm=1.0, clipped=False)


def test_an_update_without_timings_keeps_the_intervals_per_rank_sums():
    stats = IntervalStats(lambda logs: {})
    stats.add(update_result([8, 8, 16, 32], [8.0, 8.0, 8.0, 8.0]), seconds=8.5)
    first_after_restore = UpdateResult(totals={}, samples=[8, 8, 16, 32], timed_samples=[], compute_seconds=[],
                                       lr=0.1, gnorm=1.0, clipped=False)
    stats.add(first_after_restore, seconds=8.5)
    metrics = stats.metrics()
    assert [metrics[f"share{r}"] for r in range(4)] == [12.5, 12.5, 25.0, 50.0] and metrics["balance_eff"] == 1.0


def test_balance_efficiency_is_ideal_over_slowest_rank_time():
    stats = IntervalStats(lambda totals: {})
    for _ in range(3):  # equal split on speeds 1:1:2:4: the slowest rank takes 16 s, 8 s would do
        stats.add(update_result([16, 16, 16, 16], [16.0, 16.0, 8.0, 4.0]), seconds=16.5)
    assert stats.metrics()["balance_eff"] == pytest.approx(64 / 8 / 16)
    stats.reset()
    stats.add(update_result([8, 8, 16, 32], [8.0, 8.0, 8.0, 8.0]), seconds=8.5)
    stats.add(update_result([8, 8, 16, 32], [8.0, 8.0, 8.0, 12.0]), seconds=12.5)  # one slow step on rank 3
    assert stats.metrics()["balance_eff"] == pytest.approx(128 / (16 / 16 + 16 / 16 + 32 / 16 + 64 / 20) / 20)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--global-batch-size", "17", "--fixed-update-freq"], "the global batch of 17 samples does not fit in one "
                                                               "step of 1 process(es) with batch sizes [16]"),
        (["--auto-balance", "--balance-smoothing", "0"], "--balance-smoothing must be in (0, 1]"),
        (["--auto-balance", "--balance-interval", "0"], "--balance-interval must be at least 1"),
        (["--auto-balance", "--balance-start", "fastest"],
         "--balance-start must be one of probe, batch-sizes, got 'fastest'"),
        (["--balance-start", "probe"], "--balance-start needs --auto-balance"),
    ],
)
def test_bad_balance_options_are_one_line_errors(tmp_path, monkeypatch, capsys, flags, message):
    monkeypatch.chdir(tmp_path)
    code = main(["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--max-sentences", "16", "--no-save",
                 "--max-epoch", "1", "--disable-validation", "--log-format", "none", *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err


# -- a simulated cluster of three ranks ---------------------------------------------------
SEED, LR, TRAIN_SIZE, EPOCHS = 5, 0.3, 350, 2  # 15 updates per epoch, the last of 14 samples
GLOBAL_BATCH, CAPS = 24, [16, 16, 6]
SPEEDS, SPEEDS_AFTER, CHANGE_AT = [1, 2, 4], [1, 0.5, 4], 16
SPLIT, SPLIT_AFTER = [6, 12, 6], [12, 6, 6]  # rank 2 capped at 6, the other 18 go 1:2, then 2:1
CAPS_SPLIT = [10, 10, 4]  # 24 in proportion to the batch sizes: where --balance-start batch-sizes starts
INTERVAL = 3
PROBE_CALLS = 2
"""Forward calls of the balancer's start-up probe (one untimed step, one timed) before update 1."""


def sim_command(save_dir: Path, rank: int, init: str, speeds: Sequence[float], *extra: str) -> list[str]:
    return [
        "--user-dir", str(SIMCLUSTER), "--task", "sim", "--sim-train-size", str(TRAIN_SIZE),
        "--sim-speeds", ",".join(map(str, speeds)), "--sim-sample-ms", "20",
        "--optimizer", "sgd", "--lr", str(LR), "--seed", str(SEED), "--max-sentences", str(CAPS[rank]),
        "--global-batch-size", str(GLOBAL_BATCH), "--auto-balance", "--balance-interval", str(INTERVAL),
        "--balance-smoothing", "0.5", "--balance-threshold", "0.05",
        "--save-dir", str(save_dir), "--no-epoch-checkpoints", "--disable-validation",
        "--log-format", "json", "--log-interval", "1", "--distributed-timeout", "60",
        *rank_flags(rank, len(CAPS), init), *extra,
    ]


def run_sim_cluster(save_dir: Path, speeds: Sequence[float], *extra: str) -> tuple[list[dict[str, Any]], str]:
    """Run the three ranks; return rank 0's JSON log records and its other lines."""
    init = f"tcp://127.0.0.1:{free_port()}"
    commands = [sim_command(save_dir, rank, init, speeds, *extra) for rank in range(len(CAPS))]
    results = run_nodes(commands, cwd=save_dir.parent)
    for result in results:
        assert result.returncode == 0, result.stderr
    lines = results[0].stderr.splitlines()
    return ([json.loads(line) for line in lines if line.startswith("{")],
            "\n".join(line for line in lines if not line.startswith("{")))


@pytest.fixture(scope="module")
def balanced_run(tmp_path_factory) -> tuple[list[dict[str, Any]], Path, str]:
    """Three ranks of speeds 1:2:4, started from probed speeds, where rank 1 drops to speed 0.5 after update 16."""
    save_dir = tmp_path_factory.mktemp("balanced") / "ckpt"
    logs, lines = run_sim_cluster(save_dir, SPEEDS, "--max-epoch", str(EPOCHS), "--balance-warmup-updates", "2",
                                  "--sim-change-at", str(PROBE_CALLS + CHANGE_AT),
                                  "--sim-speeds-after", ",".join(map(str, SPEEDS_AFTER)))
    return logs, save_dir / "checkpoint_last.pt", lines


def load(checkpoint: Path) -> dict[str, Any]:
    return torch.load(checkpoint, map_location="cpu", weights_only=True)


def samples_per_rank(logs: list[dict[str, Any]]) -> dict[int, list[float]]:
    """Samples each rank processed at each full update, from the per-update shares in the log.

    Timings (and shares) arrive one update late: update ``u``'s shares are in the line of update ``u + 1``.
    """
    lines = [record for record in logs if record["phase"] == "train_inner"]
    return {before["num_updates"]: [round(after[f"share{r}"] * GLOBAL_BATCH / 100, 6) for r in range(len(CAPS))]
            for before, after in zip(lines, lines[1:])
            if before["bsz"] == GLOBAL_BATCH and after["num_updates"] == before["num_updates"] + 1
            and "share0" in after}


def within_one_sample(actual: Sequence[float], expected: Sequence[int]) -> bool:
    return all(abs(a - e) <= 1 for a, e in zip(actual, expected))


def reference_parameters() -> dict[str, torch.Tensor]:
    """Plain PyTorch: SGD on mean cross-entropy over consecutive global batches of each epoch's order."""
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 3, (TRAIN_SIZE,), generator=generator)
    inputs = torch.randn(TRAIN_SIZE, 8, generator=generator) + labels[:, None].float()
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for epoch in range(1, EPOCHS + 1):
        order = np.random.default_rng([SEED, epoch]).permutation(TRAIN_SIZE)
        for start in range(0, TRAIN_SIZE, GLOBAL_BATCH):
            batch = torch.as_tensor(order[start : start + GLOBAL_BATCH])
            optimizer.zero_grad()
            F.cross_entropy(model(inputs[batch]), labels[batch]).backward()
            optimizer.step()
    return {f"net.{name}": value for name, value in model.state_dict().items()}


def test_the_first_update_runs_at_the_split_of_the_probed_speeds(balanced_run):
    logs, _checkpoint, lines = balanced_run
    assert within_one_sample(samples_per_rank(logs)[1], SPLIT), samples_per_rank(logs)[1]
    started = re.search(r"^balance \| starting split (\d+),(\d+),(\d+) by the probed speeds .* ([\d.]+) s on the "
                        r"slowest rank\)$", lines, re.MULTILINE)
    assert started, lines
    assert within_one_sample([int(n) for n in started.groups()[:3]], SPLIT)
    # rank 0 probes two steps of 2 samples (of 10 at the batch sizes' split), 20 ms each: about 0.08 s
    assert float(started.group(4)) < 1.0


def test_balance_start_batch_sizes_starts_in_proportion_to_the_batch_sizes(tmp_path):
    logs, lines = run_sim_cluster(tmp_path / "ckpt", SPEEDS, "--max-update", "2", "--no-save",
                                  "--balance-start", "batch-sizes")
    assert samples_per_rank(logs)[1] == CAPS_SPLIT and "balance |" not in lines


def test_moving_the_split_does_not_change_the_parameters(balanced_run):
    logs, checkpoint, _lines = balanced_run
    state = load(checkpoint)
    # from the probed start the split moves mid-epoch after the speed change (the first update is at SPLIT)
    assert len([r for r in logs if r["phase"] == "balance"]) >= 1 and state["balance"]["resplits"] >= 1
    actual, expected = state["trainer"]["model"], reference_parameters()
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-4, atol=1e-5, msg=name)


def test_split_converges_to_the_speed_ratio_under_caps(balanced_run):
    logs = balanced_run[0]
    samples = samples_per_rank(logs)
    settled = [samples[u] for u in range(11, CHANGE_AT + 1) if u in samples]
    assert settled and all(within_one_sample(s, SPLIT) for s in settled), settled
    assert all(s[r] <= CAPS[r] for s in samples.values() for r in range(len(CAPS)))
    planned = [[record[f"split{r}"] for r in range(len(CAPS))] for record in logs if record["phase"] == "balance"]
    assert all(split[r] <= CAPS[r] for split in planned for r in range(len(CAPS)))


def test_a_slowed_down_rank_is_rebalanced_within_three_intervals(balanced_run):
    samples = samples_per_rank(balanced_run[0])
    after = [samples[u] for u in range(CHANGE_AT + 3 * INTERVAL, EPOCHS * 15 + 1) if u in samples]
    assert after and all(within_one_sample(s, SPLIT_AFTER) for s in after), after


def test_resume_continues_with_the_saved_split(balanced_run, tmp_path):
    saved = load(balanced_run[1])["balance"]["split"]
    assert within_one_sample(saved, SPLIT_AFTER) and saved != CAPS_SPLIT  # not a fresh start
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    shutil.copy(balanced_run[1], save_dir)
    # equal speeds and a long warm-up: nothing re-splits, so the first update shows the restored split, which
    # replaces the start the probe found (it runs before the checkpoint is read)
    logs, lines = run_sim_cluster(save_dir, [1, 1, 1], "--max-epoch", str(EPOCHS + 1),
                                  "--max-update", str(EPOCHS * 15 + 2), "--balance-warmup-updates", "100")
    samples = samples_per_rank(logs)
    assert samples[EPOCHS * 15 + 1] == saved and "balance | starting split " in lines

"""``--inner-steps-by time``: a node twice as fast takes twice the inner steps per update, checked against plain
PyTorch, resumed exactly, and its counts decided from the measured speeds.

The two-node job is the outer loop's toy job (nodes of 8 and 24 samples per step, DiLoCo with H = 3, inner
Adam), with node 0's forward sleeping twice as long as node 1's: 1:2 speeds, as on mixed GPUs.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import free_port, node_commands, run_nodes
from hetfair.checkpoint.layout import load_checkpoint
from hetfair.data.epoch_updates import EpochSchedule, EpochUpdates
from hetfair.data.update_shape import UpdateShape
from hetfair.parallel.inner_steps import InnerStepCounts
from hetfair_cli.train import main as train_main
from toy_plugin import Blobs, ToyMLP
from toy_reference import EPOCHS, SEED, TRAIN_SIZE, assert_same, toy_train_args

CAPS = [8, 24]
STEP_SECONDS = [0.2, 0.1]
"""Node 0's forward sleeps twice node 1's: speeds 1:2, with room for a loaded machine's scheduling delays
(10-20 ms) before the measured ratio nears the rounding point 1.5."""
INTERVAL, LR = 3, 0.01
TIME_FLAGS = ("--ddp-backend", "diloco", "--outer-interval", str(INTERVAL), "--optimizer", "adam", "--lr", str(LR),
              "--inner-steps-by", "time", "--log-format", "simple")
CHANGED_AFTER = 6
"""The counts change at the end of round 2: updates 1 and 2 are never measured, 3 to 5 are (their timings arrive
one update late), so the first decision is at the end of update 6."""


def run_time_nodes(save_dir: Path, cwd: Path, *flags: str) -> list[str]:
    commands = node_commands(toy_train_args(save_dir, None, (*TIME_FLAGS, *flags)), CAPS,
                             f"tcp://127.0.0.1:{free_port()}")
    for command, seconds in zip(commands, STEP_SECONDS):
        command += ["--toy-step-seconds", str(seconds)]
    results = run_nodes(commands, cwd=cwd)
    for result in results:
        assert result.returncode == 0, result.stderr
    return [result.stderr for result in results]


def _split(total: int, weights: Sequence[int]) -> list[int]:
    """``total`` in proportion to ``weights``, fractions by largest remainder (ties to the lower index)."""
    ideal = [total * w / sum(weights) for w in weights]
    counts = [int(x) for x in ideal]
    for index in sorted(range(len(weights)), key=lambda i: (-(ideal[i] - counts[i]), i))[:total - sum(counts)]:
        counts[index] += 1
    return counts


def reference_time_steps(counts: Sequence[int], changed_after: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch DiLoCo (H = 3, outer Nesterov SGD 0.7/0.9, inner Adam) where, after update ``changed_after``,
    node ``n`` takes ``counts[n]`` Adam steps per update: each step takes ``counts[n] * cap_n`` of the global batch
    (now ``sum_n counts[n] * cap_n`` samples), cut into ``counts[n]`` consecutive pieces, one mean-loss step each.
    Pseudo-gradients are weighted by the samples each node trained since the last meeting."""
    torch.manual_seed(SEED)
    model = ToyMLP(hidden=16)
    nodes = [copy.deepcopy(model) for _ in CAPS]
    inner = [torch.optim.Adam(node.parameters(), lr=LR) for node in nodes]
    anchor = dict(model.named_parameters())
    outer = torch.optim.SGD(anchor.values(), lr=0.7, momentum=0.9, nesterov=True)
    data = Blobs(TRAIN_SIZE, seed=0)
    trained = [0] * len(CAPS)
    done = 0

    def meet() -> None:
        with torch.no_grad():
            for name, param in anchor.items():
                param.grad = sum(n * (param - dict(node.named_parameters())[name])
                                 for n, node in zip(trained, nodes)) / sum(trained)
            outer.step()
            outer.zero_grad(set_to_none=True)
            for node in nodes:
                for name, param in node.named_parameters():
                    param.copy_(anchor[name])
        trained[:] = [0] * len(CAPS)

    for epoch in range(1, EPOCHS + 1):
        order = np.random.default_rng([SEED, epoch]).permutation(TRAIN_SIZE)
        start, in_round = 0, 0
        while start < TRAIN_SIZE:
            steps = counts if done >= changed_after else [1] * len(CAPS)
            weights = [k * cap for k, cap in zip(steps, CAPS)]
            batch = order[start:start + sum(weights)]
            bounds = np.cumsum([0, *_split(len(batch), weights)])
            for node, k in enumerate(steps):
                for piece in np.array_split(batch[bounds[node]:bounds[node + 1]], k):
                    indices = torch.as_tensor(piece)
                    inner[node].zero_grad()
                    F.cross_entropy(nodes[node](data.inputs[indices]), data.labels[indices]).backward()
                    inner[node].step()
                trained[node] += bounds[node + 1] - bounds[node]
            start, done, in_round = start + len(batch), done + 1, in_round + 1
            if in_round == INTERVAL:
                meet()
                in_round = 0
        if in_round:
            meet()
    return model.state_dict()


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory) -> tuple[Path, str]:
    """The 1:2 job trained to the end (saving at update 6, a round boundary): its save directory and rank 0's log."""
    tmp_path = tmp_path_factory.mktemp("whole")
    err, _ = run_time_nodes(tmp_path / "ckpt", tmp_path, "--save-interval-updates", str(CHANGED_AFTER))
    return tmp_path / "ckpt", err


def test_the_node_twice_as_fast_takes_twice_the_inner_steps_and_equals_plain_pytorch(whole_run):
    """From the measured 1:2 speeds, node 1 takes 2 inner steps per update (6 per round of 3 updates), node 0
    one: logged once, and kept in the checkpoint. The parameters equal plain PyTorch's with those counts from
    update 7 on (float rounding only, the exact modes' tolerance)."""
    save_dir, err = whole_run
    assert err.count("outer | inner steps per round of 3 updates by measured speed: node 0 3, node 1 6 "
                     "(1 : 2 per update, --inner-steps-by time)") == 1, err
    saved = load_checkpoint(save_dir / "checkpoint_last.pt")["trainer"]
    assert saved["optimizer"]["outer_loop"]["inner_steps"]["counts"] == [1, 2]
    assert_same(saved["model"], reference_time_steps([1, 2], CHANGED_AFTER))


def test_the_reference_tells_the_counts_apart():
    """Guards the test above: the same job with one step per node everywhere gives other parameters."""
    one, two = reference_time_steps([1, 1], CHANGED_AFTER), reference_time_steps([1, 2], CHANGED_AFTER)
    assert not all(torch.allclose(one[k], two[k], rtol=1e-4, atol=1e-5) for k in one)


def test_resume_at_a_round_boundary_keeps_the_counts_and_is_exact(whole_run, tmp_path):
    """Stopped after update 6 (where the counts changed) and resumed, the run ends where the one that only saved
    there does, bit for bit: the checkpoint's counts plan the resumed data."""
    whole, _ = whole_run
    parts = tmp_path / "parts"
    run_time_nodes(parts, tmp_path, "--max-update", str(CHANGED_AFTER))
    err, _ = run_time_nodes(parts, tmp_path)
    assert "restore | inner steps per update by node, from the checkpoint: 1 : 2 (--inner-steps-by time)" in err, err
    ended, resumed = load_checkpoint(whole / "checkpoint_last.pt")["trainer"]["model"], \
        load_checkpoint(parts / "checkpoint_last.pt")["trainer"]["model"]
    assert all(torch.equal(ended[name], resumed[name]) for name in ended)


def _decided(seconds: Sequence[Sequence[float]], nodes: Sequence[Sequence[int]] = ((0,), (1,)),
             counts: InnerStepCounts | None = None) -> tuple[InnerStepCounts, list]:
    counts = counts or InnerStepCounts(nodes)
    for timings in seconds:
        counts.observe(timings)
    return counts, counts.decide()


def test_counts_follow_the_measured_seconds_per_step_after_the_warmup():
    counts, decided = _decided([[9.0, 0.1], [9.0, 0.1], [0.4, 0.2], [0.4, 0.2]])  # the first two: start-up
    assert decided == [1, 2] and counts.counts == [1, 2]
    counts, decided = _decided([[0.3, 0.3]] * 2 + [[0.3, 0.1]] * 2)
    assert decided == [1, 3]
    _, decided = _decided([[0.3, 0.3]] * 4)
    assert decided is None  # equal speeds: one step each, as by count


def test_a_node_of_two_ranks_counts_at_its_slowest_rank():
    counts, decided = _decided([[0.0, 0.0, 0.0]] * 2 + [[0.4, 0.1, 0.2]] * 2, nodes=((0,), (1, 2)))
    assert decided == [1, 2] and counts.counts == [1, 2, 2]


def test_counts_wait_for_two_measured_updates_and_ignore_the_one_timed_at_the_old_counts():
    counts, decided = _decided([[0.4, 0.2]] * 3)
    assert decided is None and counts.counts == [1, 1]  # one measured update: not yet
    counts, decided = _decided([[0.4, 0.2]] * 2, counts=counts)
    assert decided == [1, 2]
    # the next timing ran at one step each (0.2 s for one step, not two): ignored, not read as 0.1 s per step
    counts, decided = _decided([[0.4, 0.2], [0.4, 0.4], [0.4, 0.4]], counts=counts)
    assert decided is None and counts.counts == [1, 2]


def test_decided_counts_hold_against_noise_near_the_rounding_point():
    counts, decided = _decided([[0.4, 0.2]] * 4)  # 2 : 1 per step
    assert decided == [1, 2]
    steps = counts.counts
    counts, decided = _decided([[0.53, 0.4]] * 3, counts=counts)  # 2.65 : 1, past 2.5 but within the hysteresis
    assert decided is None and counts.counts == steps
    counts, decided = _decided([[0.56, 0.4]] * 3, counts=counts)  # 2.8 : 1
    assert decided == [1, 3]


def test_counts_round_trip_a_checkpoint_and_refuse_another_world():
    counts, _ = _decided([[0.4, 0.2]] * 4)
    fresh = InnerStepCounts(((0,), (1,)))
    assert fresh.load_state_dict(counts.state_dict()) and fresh.counts == [1, 2]
    assert not InnerStepCounts(((0,), (1,), (2,))).load_state_dict(counts.state_dict())


class _Indices:
    """A dataset whose samples are their indices."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


def _collate(indices: list[int]) -> dict:
    return {"indices": indices, "nsentences": len(indices)}


def test_a_rank_of_k_steps_gets_k_micro_batches_of_its_share_and_every_sample_once():
    """Ranks of 8 and 24 samples per step at 1 : 2 inner steps: steps of 8 + 48 samples, rank 1's cut into two
    micro-batches of 24; over the epoch every sample is trained exactly once."""
    size, schedule = 200, EpochSchedule([8, 24], UpdateShape(32, 32), SEED)
    seen: list[int] = []
    for rank in range(2):
        updates = list(EpochUpdates(_Indices(size), _collate, schedule, rank, 1, start=0, split=lambda: None,
                                    inner_steps=lambda: [1, 2]))
        assert [update.global_samples for update in updates] == [56, 56, 56, 32]
        assert all(update.steps == 1 for update in updates)
        sizes = [[batch["nsentences"] for batch in update.micro_batches] for update in updates]
        assert sizes == ([[8]] * 3 + [[5]] if rank == 0 else [[24, 24]] * 3 + [[14, 13]])
        seen += [index for update in updates for batch in update.micro_batches for index in batch["indices"]]
    assert sorted(seen) == list(range(size))


@pytest.mark.parametrize("flags, message", [
    (("--inner-steps-by", "time"), "--inner-steps-by needs --ddp-backend diloco or localsgd (this command has --ddp-backend c10d)"),
    (("--ddp-backend", "diloco", "--inner-steps-by", "time", "--auto-balance"),
     "--auto-balance and --inner-steps-by time both share the work by speed: drop one"),
    (("--ddp-backend", "diloco", "--inner-steps-by", "time", "--precision", "fp16"),
     "--inner-steps-by time cannot run with fp16's loss scaling"),
], ids=["not-an-outer-loop", "with-auto-balance", "with-fp16"])
def test_bad_inner_step_flags_are_one_line(tmp_path, capsys, flags, message):
    code = train_main(toy_train_args(tmp_path / "ckpt", None, flags))
    [line] = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert line.startswith("hetfair-train: error: ") and message in line, line

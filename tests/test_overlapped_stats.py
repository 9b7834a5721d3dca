"""The stats all-reduce overlaps the last backward: same update as plain PyTorch, only timings one update late.

Two real gloo processes drive :class:`Trainer` directly with uneven micro-batches
(rank 0: 3 + 5 samples, rank 1: 8 + none, so rank 1's last micro-batch only
joins the collectives), and the result is compared with one plain-PyTorch loop
over the same global batches: ``sum of losses / global count``, SGD.
"""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from helpers import TOY_PLUGIN, leave_group, run_nodes
from hetfair.parallel.context import DistributedContext
from hetfair.optim.lr_scheduler.fixed import FixedSchedule
from hetfair.trainer import Trainer, TrainerConfig
from hetfair.launch.supervisor import run_workers

UPDATES = 3
LR = 0.1
RANK_SIZES = [[3, 5], [8, 0]]  # micro-batch sizes per rank (0: no data in that micro-batch)
CLIP = 0.5


class SumCrossEntropy(nn.Module):
    """The criterion contract in miniature: summed loss, sample count, summable logs."""

    def forward(self, model: nn.Module, sample: dict[str, Any]) -> tuple[torch.Tensor, int, dict[str, float]]:
        loss = F.cross_entropy(model(sample["x"]), sample["y"], reduction="sum")
        return loss, len(sample["y"]), {"loss": float(loss.detach()), "nsentences": float(len(sample["y"]))}


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    size = sum(map(sum, RANK_SIZES))
    return [(torch.randn(size, 6, generator=generator), torch.randint(0, 3, (size,), generator=generator))
            for _ in range(UPDATES)]


def initial_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def rank_micro_batches(rank: int, x: torch.Tensor, y: torch.Tensor) -> list[Optional[dict[str, Any]]]:
    """This rank's slices of the global batch: ranks in order, micro-batches in order."""
    start = sum(map(sum, RANK_SIZES[:rank]))
    batches: list[Optional[dict[str, Any]]] = []
    for size in RANK_SIZES[rank]:
        batches.append({"x": x[start:start + size], "y": y[start:start + size], "nsentences": size} if size else None)
        start += size
    return batches


class Tally:
    """A rider: sends ``rank + 1`` (and a constant) with each update's stats, keeps the sums that come back."""

    def __init__(self, rank: int) -> None:
        self.rank, self.sums = rank, []

    def ride(self) -> dict[str, float]:
        return {"rank_plus_one": float(self.rank + 1), "one": 1.0}

    def arrive(self, sums: dict[str, float]) -> None:
        self.sums.append(sums)


def _rank(rank: int, world: int, store: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    context = DistributedContext(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    schedule = Namespace(lr=LR, warmup_updates=0)
    trainer = Trainer(TrainerConfig(clip_norm=CLIP, optimizer="sgd"), initial_model(), SumCrossEntropy(), context,
                      dummy_batch={"x": torch.zeros(1, 6), "y": torch.zeros(1, dtype=torch.long), "nsentences": 1},
                      optimizer_factory=lambda params: torch.optim.SGD(params, lr=LR),
                      lr_scheduler_factory=lambda optimizer: FixedSchedule(schedule, optimizer))
    results = []
    tally = Tally(rank)
    for x, y in global_batches():
        result = trainer.train_step(rank_micro_batches(rank, x, y), rider=tally)
        assert result is not None
        results.append({"loss": result.totals["loss"], "sample_size": result.totals["sample_size"],
                        "samples": result.samples,
                        "timed_samples": result.timed_samples, "seconds": len(result.compute_seconds), "gnorm": result.gnorm})
    params = {name: p.detach().tolist() for name, p in trainer.model.named_parameters()}
    Path(out_dir, f"{rank}.json").write_text(json.dumps({"results": results, "params": params, "riders": tally.sums}))
    del trainer
    leave_group()


def plain_pytorch() -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    """One process, whole global batches, mean loss: the update hetfair must reproduce."""
    model = initial_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    stats = []
    for x, y in global_batches():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y, reduction="sum")
        (loss / len(y)).backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        stats.append({"loss": float(loss.detach()), "gnorm": float(gnorm)})
    return stats, dict(model.named_parameters())


def test_overlapped_stats_sync_gives_plain_pytorchs_update_and_only_timings_one_update_late(tmp_path):
    world = len(RANK_SIZES)
    run_workers(world, 0, _rank, (world, str(tmp_path / "store"), str(tmp_path)))
    expected_stats, expected_params = plain_pytorch()
    outputs = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(world)]
    for output in outputs:
        for name, value in output["params"].items():
            torch.testing.assert_close(torch.tensor(value), expected_params[name].detach(), rtol=1e-5, atol=1e-6)
        for update, (result, expected) in enumerate(zip(output["results"], expected_stats)):
            assert result["sample_size"] == sum(map(sum, RANK_SIZES))
            assert abs(result["loss"] - expected["loss"]) <= 1e-5 * abs(expected["loss"])
            assert abs(result["gnorm"] - expected["gnorm"]) <= 1e-5 * expected["gnorm"]
            # counts are the update's own; the first update carries no timings, each later one the previous update's
            rank_samples = [float(sum(sizes)) for sizes in RANK_SIZES]
            assert result["samples"] == rank_samples
            assert result["timed_samples"] == ([] if update == 0 else rank_samples)
            assert result["seconds"] == (0 if update == 0 else world)
        # the rider's values travel in the same all-reduce, summed over ranks, once per update
        assert output["riders"] == [{"rank_plus_one": 3.0, "one": 2.0}] * UPDATES


SHARES = [4, 4, 16]  # 98 samples: four steps of 24, then one of 2, split 1 : 0 : 1 (largest remainder, ties low)
EPOCH_SAMPLES = [4 * size + last for size, last in zip(SHARES, [1, 0, 1])]


def test_per_rank_shares_belong_to_their_own_update_and_epoch(tmp_path):
    args = ["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--toy-train-size", "98", "--max-epoch", "2",
            "--distributed-world-size", "3", "--max-sentences", ",".join(map(str, SHARES)), "--log-format", "json",
            "--log-interval", "1", "--disable-validation", "--no-save", "--distributed-timeout", "60"]
    [result] = run_nodes([args], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    inner = [r for r in records if r["phase"] == "train_inner"]
    full, last = [100 * s / 24 for s in SHARES], [50.0, 0.0, 50.0]
    for record, (shares, bsz) in zip(inner, 2 * ([(full, 24.0)] * 4 + [(last, 2.0)])):
        assert [record[f"share{r}"] for r in range(3)] == pytest.approx(shares) and record["bsz"] == bsz, record
    for epoch in [r for r in records if r["phase"] == "train"]:
        assert [epoch[f"share{r}"] for r in range(3)] == pytest.approx([100 * s / 98 for s in EPOCH_SAMPLES])
        assert epoch["bsz"] == pytest.approx(98 / 5)

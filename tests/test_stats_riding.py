"""On gloo the update's stats ride DDP's first gradient bucket: one all-reduce per update where there were two,
the same update as plain PyTorch, and counts that float32 cannot sum exactly fall back to the float64 all-reduce.

Two real gloo processes drive :class:`Trainer` (the replicated strategy, DDP with the exact all-reduce) on a
model small enough for one bucket; each counts the all-reduces gloo runs in an update with torch's profiler.
"""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from helpers import leave_group
from hetfair.launch.supervisor import run_workers
from hetfair.optim.lr_scheduler.fixed import FixedSchedule
from hetfair.parallel.context import DistributedContext
from hetfair.trainer import Trainer, TrainerConfig

LR = 0.1
BATCH = 4
BIG_COUNT = 2 ** 24 + 1
"""A count float32 cannot hold (it rounds to 2**24): a rank sending it must not have it summed in float32."""


class CountingCrossEntropy(nn.Module):
    """A summed loss, its sample count, and a logged ``count`` of this rank's choosing."""

    def __init__(self, count: float) -> None:
        super().__init__()
        self.count = count

    def forward(self, model: nn.Module, sample: dict[str, Any]) -> tuple[torch.Tensor, int, dict[str, float]]:
        loss = F.cross_entropy(model(sample["x"]), sample["y"], reduction="sum")
        return loss, len(sample["y"]), {"loss": float(loss.detach()), "count": self.count}


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(BATCH, 6, generator=generator), torch.randint(0, 3, (BATCH,), generator=generator))
            for _ in range(3)]


def initial_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _rank(rank: int, world: int, store: str, out_dir: str, count: float) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    context = DistributedContext(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    schedule = Namespace(lr=LR, warmup_updates=0)
    trainer = Trainer(TrainerConfig(optimizer="sgd"), initial_model(), CountingCrossEntropy(count), context,
                      dummy_batch={"x": torch.zeros(1, 6), "y": torch.zeros(1, dtype=torch.long), "nsentences": 1},
                      optimizer_factory=lambda params: torch.optim.SGD(params, lr=LR),
                      lr_scheduler_factory=lambda optimizer: FixedSchedule(schedule, optimizer))
    updates = []
    for x, y in batches(rank):
        with profile(activities=[ProfilerActivity.CPU]) as profiled:
            result = trainer.train_step([{"x": x, "y": y, "nsentences": BATCH}])
        assert result is not None
        all_reduces = sum(1 for event in profiled.events() if event.name == "gloo:all_reduce")
        updates.append({"all_reduces": all_reduces, "count": result.totals["count"],
                        "sample_size": result.totals["sample_size"], "samples": result.samples})
    params = {name: p.detach().tolist() for name, p in trainer.model.named_parameters()}
    Path(out_dir, f"{rank}.json").write_text(json.dumps({"updates": updates, "params": params}))
    del trainer
    leave_group()


def plain_pytorch(world: int) -> dict[str, torch.Tensor]:
    """One process, every rank's batch of an update together, mean loss."""
    model = initial_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in zip(*(batches(rank) for rank in range(world))):
        optimizer.zero_grad()
        x, y = torch.cat([x for x, _ in step]), torch.cat([y for _, y in step])
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return dict(model.named_parameters())


@pytest.mark.parametrize("count, all_reduces", [(3.0, 1), (BIG_COUNT, 2)], ids=["riding", "too-big-for-float32"])
def test_the_stats_ride_the_gradient_all_reduce_and_counts_stay_exact(tmp_path, count, all_reduces):
    world = 2
    run_workers(world, 0, _rank, (world, str(tmp_path / "store"), str(tmp_path), count))
    expected = plain_pytorch(world)
    for rank in range(world):
        output = json.loads((tmp_path / f"{rank}.json").read_text())
        for name, value in output["params"].items():
            torch.testing.assert_close(torch.tensor(value), expected[name].detach(), rtol=1e-5, atol=1e-6)
        for update in output["updates"]:
            assert update["all_reduces"] == all_reduces, update  # the bucket's (and the float64 fallback's)
            assert update["count"] == world * count  # exact: 2 * (2**24 + 1) is not a float32
            assert update["sample_size"] == world * BATCH and update["samples"] == [float(BATCH)] * world

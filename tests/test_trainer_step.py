"""One process's ``Trainer.train_step``: train mode after validation, timings one update late."""

from __future__ import annotations

from argparse import Namespace

import torch
from torch import nn

from hetfair.distributed.context import DistributedContext
from hetfair.optim.lr_scheduler.fixed import FixedSchedule
from hetfair.trainer import Trainer, TrainerConfig
from test_overlapped_stats import SumCrossEntropy


def one_process_trainer(model: nn.Module) -> Trainer:
    context = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    return Trainer(TrainerConfig(optimizer="sgd"), model, SumCrossEntropy(), context,
                   dummy_batch={"x": torch.zeros(1, 6), "y": torch.zeros(1, dtype=torch.long), "nsentences": 1},
                   optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
                   lr_scheduler_factory=lambda optimizer: FixedSchedule(Namespace(lr=0.1, warmup_updates=0), optimizer))


def batch(size: int) -> dict:
    generator = torch.Generator().manual_seed(size)
    return {"x": torch.randn(size, 6, generator=generator), "y": torch.randint(0, 3, (size,), generator=generator),
            "nsentences": size}


def test_an_update_after_validation_trains_in_train_mode():
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 3))
    trainer = one_process_trainer(model)
    trainer.train_step([batch(4)])
    model.eval()  # what validation does
    trainer.criterion.eval()
    trainer.train_step([batch(4)])
    assert model.training and model[1].training and trainer.criterion.training


def test_each_update_reports_the_previous_updates_samples():
    trainer = one_process_trainer(nn.Linear(6, 3))
    results = [trainer.train_step([batch(size)]) for size in (4, 7, 5)]
    assert [r.samples for r in results] == [[], [4.0], [7.0]]
    assert [len(r.compute_seconds) for r in results] == [0, 1, 1] and results[2].compute_seconds[0] > 0
    assert [r.totals["sample_size"] for r in results] == [4.0, 7.0, 5.0]  # the logs are the update's own

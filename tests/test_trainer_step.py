"""One process's ``Trainer.train_step``: train mode after validation, timings one update late, the update's math."""

from __future__ import annotations

import copy
from argparse import Namespace

import pytest
import torch
from torch import nn

from hetfair.parallel.context import DistributedContext
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


def test_each_update_reports_its_own_samples_and_the_previous_updates_timings():
    trainer = one_process_trainer(nn.Linear(6, 3))
    results = [trainer.train_step([batch(size)]) for size in (4, 7, 5)]
    assert [r.samples for r in results] == [[4.0], [7.0], [5.0]]
    assert [r.timed_samples for r in results] == [[], [4.0], [7.0]]
    assert [len(r.compute_seconds) for r in results] == [0, 1, 1] and results[2].compute_seconds[0] > 0
    assert [r.totals["sample_size"] for r in results] == [4.0, 7.0, 5.0]  # the logs are the update's own


def test_one_process_times_its_compute_without_a_hook_per_parameter():
    """No peer to wait for: the backward's end is the compute's end, so no parameter carries a timing hook."""
    trainer = one_process_trainer(nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 3)))
    assert all(getattr(p, "_post_accumulate_grad_hooks", None) in (None, {}) for p in trainer.params)
    trainer.train_step([batch(4)])
    seconds = trainer.train_step([batch(4)]).compute_seconds
    assert len(seconds) == 1 and seconds[0] > 0


@pytest.mark.parametrize("make_optimizer", [
    pytest.param(lambda params: torch.optim.Adam(params, lr=0.01, fused=True), id="adam-fused"),
    pytest.param(lambda params: torch.optim.Adam(params, lr=0.01, foreach=True), id="adam-foreach"),
    pytest.param(lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True), id="sgd-fused"),
])
@pytest.mark.parametrize("clip_norm", [0.0, 0.3])
def test_normalised_and_clipped_update_equals_plain_pytorch(make_optimizer, clip_norm):
    """A fused step divides the gradients itself (``grad_scale``); either way the update, and the reported
    norm, are plain PyTorch's mean-loss update with ``clip_grad_norm_``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    reference = copy.deepcopy(model)
    context = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    trainer = Trainer(TrainerConfig(clip_norm=clip_norm), model, SumCrossEntropy(), context,
                      dummy_batch=batch(1), optimizer_factory=make_optimizer,
                      lr_scheduler_factory=lambda optimizer: FixedSchedule(Namespace(lr=optimizer.defaults["lr"],
                                                                                     warmup_updates=0), optimizer))
    assert trainer._scales_in_step == bool(trainer.optimizer.defaults.get("fused"))
    optimizer = make_optimizer(list(reference.parameters()))
    for update in range(4):
        micro_batches = [batch(4 + update), batch(7 + update)]  # one update over two micro-batches
        result = trainer.train_step(micro_batches)

        optimizer.zero_grad()
        total = sum(b["nsentences"] for b in micro_batches)
        for b in micro_batches:
            (nn.functional.cross_entropy(reference(b["x"]), b["y"], reduction="sum") / total).backward()
        norm = (torch.nn.utils.clip_grad_norm_(reference.parameters(), clip_norm) if clip_norm
                else torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]))
        optimizer.step()

        assert result.gnorm == pytest.approx(float(norm), rel=1e-5)
        assert result.clipped == (clip_norm > 0 and float(norm) > clip_norm)
        for ours, theirs in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-7)  # left normalised (and clipped)

"""A gloo rank that trains the toy model update by update and records its state (spawned by the tests).

Rank 0 runs fp32, rank 1 fp16; at :data:`POISONED_STEP` rank 1 gets a sample whose
features are 1e6, which is inf in fp16, so only that rank's gradients overflow.
Each rank saves, after every step, what the update reported and its parameters
and optimizer state.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist

from helpers import TOY_PLUGIN, leave_group
from hetfair.parallel.context import DistributedContext
from hetfair.options import parse_train_args
from hetfair.precision.mixed import LossScaleConfig, job_loss_scaler
from hetfair.run.startup import LOSS_SCALE, RankFacts, agree_at_start_up
from hetfair.tasks import TASK_REGISTRY
from hetfair.run.wiring import build_trainer

PRECISIONS = ("fp32", "fp16")
POISONED_STEP, POISONED_RANK = 2, 1
STEPS = 5
SCALE_WINDOW = 2
PER_RANK = 8


def run_rank(rank: int, init_method: str, out_dir: str) -> None:
    world_size = len(PRECISIONS)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        records = train(DistributedContext(rank, world_size, rank, torch.device("cpu")))
        torch.save(records, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        leave_group()


def train(context: DistributedContext) -> list[dict]:
    args = parse_train_args(["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--optimizer", "sgd", "--momentum",
                             "0.9", "--lr", "0.1", "--precision", PRECISIONS[context.rank],
                             "--fp16-scale-window", str(SCALE_WINDOW)])
    torch.manual_seed(0)
    task = TASK_REGISTRY.get("toy").setup_task(args)
    data = task.dataset("train")
    model = task.build_model(args)
    loss_scale = LossScaleConfig.from_args(args, context.world_size)
    job = agree_at_start_up(context, RankFacts(args.precision, PER_RANK, PER_RANK,
                                               {LOSS_SCALE: loss_scale.shared_settings()}))
    scaler = job_loss_scaler(job.precisions, loss_scale)
    trainer = build_trainer(args, model, task.build_criterion(args), context, task.collater([data[0]]), scaler)
    records = []
    for step in range(STEPS):
        first = (step * context.world_size + context.rank) * PER_RANK
        sample = task.collater([data[i] for i in range(first, first + PER_RANK)])
        if (step, context.rank) == (POISONED_STEP, POISONED_RANK):
            sample["net_input"]["x"][0] = 1e6
        result = trainer.train_step([sample])
        assert result is not None
        records.append({
            "skipped": result.skipped, "loss_scale": result.loss_scale, "num_updates": trainer.num_updates,
            "params": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(trainer.optimizer.state_dict()),
        })
    return records

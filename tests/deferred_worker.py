"""A gloo rank of a fully sharded model of ~150 MB that is built deferred, then restored from a checkpoint,
measuring its peak resident memory in each phase (spawned by tests/test_deferred_init.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from hetfair.checkpoint.layout import load_checkpoint, model_weights
from hetfair.memory.peak import current_bytes, peak_bytes, reset_peak
from hetfair.models.deferred_init import build_deferred
from hetfair.parallel import ParallelConfig, build_strategy
from hetfair.parallel.context import DistributedContext

WORLD_SIZE = 2
WIDTH, LAYERS = 2048, 9  # 9 weights of 16 MiB: 144 MiB of parameters
CPU = torch.device("cpu")


def big_model() -> nn.Module:
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)))


def warm_up(strategy_config: ParallelConfig, context: DistributedContext) -> None:
    """Page in the code the measured phases run (torch's kernels, FSDP's), so that they count tensors only."""
    model = build_deferred(lambda: nn.Sequential(nn.Linear(64, 64, bias=False)))
    build_strategy(strategy_config, context).shard(model, list(model))


def growth(run) -> int:
    """How far above the resident set at its start ``run()`` took the process's peak."""
    reset_peak(CPU)
    start = current_bytes(CPU)
    run()
    return peak_bytes(CPU) - start


def run_rank(rank: int, init_method: str, checkpoint: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD_SIZE)
    try:
        config, context = ParallelConfig(ddp_backend="fully_sharded"), DistributedContext(rank, WORLD_SIZE, rank, CPU)
        warm_up(config, context)
        torch.manual_seed(1)
        strategy = build_strategy(config, context)
        holder: dict[str, nn.Module] = {}

        def build_and_shard() -> None:
            holder["model"] = model = build_deferred(big_model)
            strategy.shard(model, list(model))

        built = growth(build_and_shard)
        model = holder["model"]
        local = {name: param.to_local().clone() for name, param in model.named_parameters()}

        def restore() -> None:
            strategy.load_model_state_dict(model, model_weights(load_checkpoint(Path(checkpoint), mmap=True)))

        restored = growth(restore)
        loaded = {name: param.to_local().clone() for name, param in model.named_parameters()}
        torch.save({"initial": local, "restored": loaded}, Path(out_dir, f"rank{rank}.pt"))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"built": built, "restored": restored}))
        dist.barrier()
    finally:
        dist.destroy_process_group()

"""A gloo rank that polls :class:`StopAgreement` at every "update" while its own signal comes at its own
update (spawned by the tests): rank 1 is preempted at update :data:`SIGNALLED_AT`, rank 0 only later. With
``riding``, each update's collective is a stats all-reduce that carries the vote (as the trainer's does)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from hetfair.launch import preemption
from hetfair.parallel.context import DistributedContext
from hetfair.parallel.stats import start_sync_stats

WORLD_SIZE = 2
SIGNALLED_AT = {0: 6, 1: 2}  # rank -> the update after which its process gets SIGUSR1
UPDATES = 10


def run_rank(rank: int, init_method: str, out_dir: str, riding: bool = False) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD_SIZE)
    try:
        context = DistributedContext(rank, WORLD_SIZE, rank, torch.device("cpu"))
        agreement = preemption.StopAgreement(context)
        stopped_after = None
        for update in range(UPDATES):
            if riding:
                agreement.arrive(start_sync_stats(context, {"loss": 1.0}, {}, agreement.ride()).wait().riders)
            else:
                dist.all_reduce(torch.ones(3))  # the update's own collectives run while the vote is in flight
            if update == SIGNALLED_AT[rank]:
                preemption.request(signal.SIGUSR1)
            if agreement.poll():
                stopped_after = update
                break
        agreement.close()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(stopped_after))
        dist.barrier()
    finally:
        dist.destroy_process_group()

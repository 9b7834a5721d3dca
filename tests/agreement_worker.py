"""A gloo rank that polls :class:`StopAgreement` at every "update" while its own signal comes at its own
update (spawned by the tests): rank 1 is preempted at update :data:`SIGNALLED_AT`, rank 0 only later."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from hetfair.launch import preemption
from hetfair.parallel.context import DistributedContext

WORLD_SIZE = 2
SIGNALLED_AT = {0: 6, 1: 2}  # rank -> the update after which its process gets SIGUSR1
UPDATES = 10


def run_rank(rank: int, init_method: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD_SIZE)
    try:
        agreement = preemption.StopAgreement(DistributedContext(rank, WORLD_SIZE, rank, torch.device("cpu")))
        stopped_after = None
        for update in range(UPDATES):
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

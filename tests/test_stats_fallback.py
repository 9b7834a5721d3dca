"""The stats fallback for values that cannot be summed: JSON in a byte tensor over real gloo, never pickle; riders
summed either way."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from hetfair.parallel.context import DistributedContext
from hetfair.parallel.stats import start_sync_stats, sync_stats
from hetfair.errors import ConfigError
from hetfair.launch.supervisor import run_workers


def _rank(rank: int, world: int, store_path: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    context = DistributedContext(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    synced = start_sync_stats(context, {"loss": 1.5 * (rank + 1), "sample_size": 2.0, "note": f"rank{rank}"},
                              {"samples": float(rank + 1)}, {"vote": float(rank == 1)}).wait()
    packed = start_sync_stats(context, {"loss": 1.0}, {}, {"vote": float(rank)}).wait()
    try:
        sync_stats(context, {"loss": 1.0, "sample_size": 1.0, "weird": object()}, {})
        refused = ""
    except ConfigError as exc:
        refused = str(exc)
    Path(out_dir, f"{rank}.json").write_text(json.dumps({"totals": synced.totals, "per_rank": synced.per_rank,
                                                          "riders": [synced.riders, packed.riders],
                                                          "packed": packed.totals, "refused": refused}))
    dist.barrier()
    dist.destroy_process_group()


def test_values_that_cannot_be_summed_are_gathered_as_json(tmp_path):
    world = 3
    run_workers(world, 0, _rank, (world, str(tmp_path / "store"), str(tmp_path)))
    for rank in range(world):
        result = json.loads((tmp_path / f"{rank}.json").read_text())
        assert result["totals"] == {"loss": 1.5 + 3.0 + 4.5, "sample_size": 6.0, "note": ["rank0", "rank1", "rank2"]}
        assert result["per_rank"] == {"samples": [1.0, 2.0, 3.0]}
        # riders are summed apart from the stats, by the packed all-reduce and by the JSON fallback alike
        assert result["riders"] == [{"vote": 1.0}, {"vote": 0.0 + 1.0 + 2.0}]
        assert result["packed"] == {"loss": 3.0}
        assert "a logged value cannot be sent to the other ranks" in result["refused"]

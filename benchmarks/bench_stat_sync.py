"""The overlapped stats all-reduce against waiting for it at once: DDP updates on gloo ranks.

Each rank builds one :class:`hetfair.trainer.Trainer` (the MNIST plugin's model,
hetfair's cross-entropy, Adam) and runs blocks of updates in two modes, alternating
in the same processes so that a busy machine slows both alike:

* ``overlapped``: the trainer as it is (the all-reduce runs during the last backward);
* ``waited``: the same trainer, with the all-reduce waited for right after it starts
  (the stats round trip before the backward, as before the overlap).

Reported: wall milliseconds per update (rank 0's clock, a barrier before each block)
and the median over repetitions of overlapped/waited for adjacent blocks (< 1: faster).

    python benchmarks/bench_stat_sync.py [--models mnist_mlp,mnist_cnn] [--ranks 2] [--repeats 9]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import machine_note, plain_model, print_table  # noqa: E402

MODES = ("overlapped", "waited")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mnist_mlp,mnist_cnn", help="architectures of the MNIST plugin")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64, help="samples per rank and update")
    parser.add_argument("--block", type=int, default=20, help="updates per timed block")
    parser.add_argument("--repeats", type=int, default=9, help="timed blocks per mode")
    parser.add_argument("--warmup", type=int, default=10)
    return parser.parse_args()


class _Waited:
    """A pending stats sync that is already done: what :func:`waited` returns."""

    def __init__(self, pending: Any) -> None:
        self._synced = pending.wait()

    def wait(self) -> Any:
        return self._synced


def build_trainer(arch: str, rank: int, world: int, batch_size: int) -> tuple[Any, list[dict[str, Any]]]:
    """A trainer of ``arch`` on this rank and a pool of random MNIST-shaped batches."""
    from hetfair.criteria.cross_entropy import CrossEntropyCriterion
    from hetfair.parallel.context import DistributedContext
    from hetfair.optim.lr_scheduler.fixed import FixedSchedule
    from hetfair.trainer import Trainer, TrainerConfig

    torch.manual_seed(1)
    model = plain_model(arch)
    context = DistributedContext(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(rank)

    def batch(size: int) -> dict[str, Any]:
        return {"net_input": {"x": torch.randn(size, 1, 28, 28, generator=generator)},
                "target": torch.randint(0, 10, (size,), generator=generator), "nsentences": size, "ntokens": size}

    trainer = Trainer(TrainerConfig(optimizer="adam"), model, CrossEntropyCriterion(None), context, batch(1),
                      optimizer_factory=lambda params: torch.optim.Adam(params, lr=1e-3),
                      lr_scheduler_factory=lambda opt: FixedSchedule(Namespace(lr=1e-3, warmup_updates=0), opt))
    return trainer, [batch(batch_size) for _ in range(8)]


def _rank(rank: int, world: int, store: str, out: str, options: dict[str, Any]) -> None:
    import hetfair.trainer as trainer_module

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    overlapped = trainer_module.start_sync_stats
    starts = {"overlapped": overlapped, "waited": lambda *a: _Waited(overlapped(*a))}
    results: dict[str, dict[str, list[float]]] = {}
    for arch in options["models"]:
        trainer, batches = build_trainer(arch, rank, world, options["batch_size"])
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        for i in range(options["warmup"]):
            trainer.train_step([batches[i % len(batches)]])
        for repeat in range(options["repeats"]):
            for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
                trainer_module.start_sync_stats = starts[mode]
                dist.barrier()
                start = time.perf_counter()
                for i in range(options["block"]):
                    trainer.train_step([batches[i % len(batches)]])
                times[mode].append((time.perf_counter() - start) / options["block"])
        trainer_module.start_sync_stats = overlapped
        results[arch] = times
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    models = [m for m in args.models.split(",") if m]
    print(f"bench_stat_sync: {machine_note()}; {args.ranks} gloo ranks, batch {args.batch_size} per rank")
    with tempfile.TemporaryDirectory(prefix="bench_stat_sync_") as tmp:
        out = str(Path(tmp) / "result.json")
        options = {"models": models, "warmup": args.warmup, "repeats": args.repeats, "block": args.block,
                   "batch_size": args.batch_size}
        mp.spawn(_rank, args=(args.ranks, str(Path(tmp) / "store"), out, options), nprocs=args.ranks)
        results = json.loads(Path(out).read_text())
    rows = []
    for arch, times in results.items():
        ratios = [a / b for a, b in zip(times["overlapped"], times["waited"])]
        rows.append([arch, *(f"{statistics.median(times[m]) * 1e3:.2f}" for m in MODES),
                     f"{statistics.median(ratios):.3f}", f"{min(ratios):.2f}..{max(ratios):.2f}"])
    print_table(f"Per update, {args.ranks} ranks: stats all-reduce overlapped vs waited at once "
                f"({args.repeats} x {args.block} updates each, alternating; median)",
                ["model", "overlapped ms", "waited ms", "ratio", "spread"], rows,
                notes=["ratio = median over repetitions of overlapped/waited of adjacent blocks (< 1: faster)",
                       f"load average at the end: {os.getloadavg()[0]:.1f}"])


if __name__ == "__main__":
    main()

"""DDP's bucket options on 2 gloo ranks: ``--bucket-cap-mb`` sizes and ``gradient_as_bucket_view``.

Every variant is a DistributedDataParallel copy of the same model in the same
process group; the ranks alternate blocks of updates between the variants (the
order rotating every repetition), so all of them see the same machine load,
which other jobs keep changing. Reported: each variant's median time per update
(forward, backward with the gradient all-reduce, Adam step) relative to the
default (25 MiB buckets, gradients copied out of them), and its CPU time.

    .venv/bin/python benchmarks/bench_ddp_options.py            # mnist_cnn and bert_mini (a few minutes)
    .venv/bin/python benchmarks/bench_ddp_options.py --quick    # mnist_cnn only, fewer updates
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Samples, free_port, machine_note, plain_model, print_table, ratio  # noqa: E402

VARIANTS: dict[str, dict[str, Any]] = {
    "25 MiB, copy (torch default)": {"bucket_cap_mb": 25, "gradient_as_bucket_view": False},
    "25 MiB, bucket view (hetfair)": {"bucket_cap_mb": 25, "gradient_as_bucket_view": True},
    "5 MiB, bucket view": {"bucket_cap_mb": 5, "gradient_as_bucket_view": True},
    "100 MiB, bucket view": {"bucket_cap_mb": 100, "gradient_as_bucket_view": True},
}


def workload(name: str, batch: int) -> tuple[Callable[[], torch.nn.Module], Callable[[torch.nn.Module], None]]:
    """A model factory and one forward/backward on a fixed random batch."""
    if name.startswith("bert"):
        from hetfair.bert.model import BertConfig, BertModel

        sizes = {"bert_tiny": (128, 2, 2), "bert_mini": (256, 4, 4)}[name]
        config = BertConfig(vocab_size=8000, hidden_size=sizes[0], num_hidden_layers=sizes[1],
                            num_attention_heads=sizes[2], intermediate_size=4 * sizes[0])
        ids = torch.randint(5, 8000, (batch, 128))
        masked = torch.rand(batch, 128) < 0.15

        def bert_step(model: torch.nn.Module) -> None:
            logits = model(ids, torch.zeros_like(ids), masked_tokens=masked)["mlm_logits"]
            F.cross_entropy(logits, ids[masked]).backward()

        return lambda: BertModel(config), bert_step
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))

    def image_step(model: torch.nn.Module) -> None:
        F.cross_entropy(model(x), y).backward()

    return lambda: plain_model(name), image_step


def rank_main(rank: int, args: argparse.Namespace, port: int, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        for model_name in args.models.split(","):
            build, step = workload(model_name, args.batch_size)
            torch.manual_seed(0)
            base = build()
            runs = {}
            for name, options in VARIANTS.items():
                model = build()
                model.load_state_dict(base.state_dict())
                ddp = DistributedDataParallel(model, **options)
                runs[name] = (ddp, torch.optim.Adam(model.parameters(), lr=1e-4, fused=True))
            wall = {name: Samples() for name in runs}
            cpu = {name: Samples() for name in runs}
            names = list(runs)
            for rep in range(args.warmup_blocks + args.repeats):
                shift = rep % len(names)
                for name in names[shift:] + names[:shift]:
                    ddp, optimizer = runs[name]
                    dist.barrier()
                    started, cpu_started = time.perf_counter(), time.process_time()
                    for _ in range(args.block):
                        optimizer.zero_grad(set_to_none=True)
                        step(ddp)
                        optimizer.step()
                    if rep >= args.warmup_blocks:
                        wall[name].add((time.perf_counter() - started) / args.block)
                        cpu[name].add((time.process_time() - cpu_started) / args.block)
            if rank == 0:
                results[model_name] = {name: (wall[name].values, cpu[name].values) for name in names}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mnist_cnn,bert_mini")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank")
    parser.add_argument("--block", type=int, default=10, help="updates per timed block")
    parser.add_argument("--repeats", type=int, default=6, help="timed blocks per variant")
    parser.add_argument("--warmup-blocks", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.repeats, args.block = "mnist_cnn", 3, 5
    print(f"bench_ddp_options: {machine_note()}; 2 ranks x 1 thread, {args.batch_size} samples per rank", flush=True)
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank_main, args=(args, free_port(), results), nprocs=2)
        results = dict(results)
    rows = []
    for model_name, by_variant in results.items():
        base_wall, base_cpu = by_variant[next(iter(VARIANTS))]
        for name, (wall, cpu) in by_variant.items():
            speed = Samples([ratio(b, w) for b, w in zip(base_wall, wall)])
            rows.append([model_name, name, f"{Samples(wall).median * 1e3:.1f}", f"{speed.median:.3f}",
                         speed.spread(), f"{Samples(cpu).median * 1e3:.1f}",
                         f"{Samples([ratio(b, c) for b, c in zip(base_cpu, cpu)]).median:.3f}"])
    print_table(f"per update on rank 0, {args.repeats} alternating blocks of {args.block} (median, min..max)",
                ["model", "DDP variant", "ms", "speed vs default", "spread", "cpu ms", "cpu speed"], rows,
                notes=["speed = default time / variant time in the same repetition (> 1: faster)"])
    print(f"\n{machine_note()}")


if __name__ == "__main__":
    main()

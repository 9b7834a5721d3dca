"""Per-rank memory of data parallel (none), ZeRO-1 (os), fully sharded (FSDP2) and uneven BERT training.

For each mode and world size, real gloo processes build hetfair's Trainer around BERT (built as
hetfair-train builds it: deferred where the strategy asks, so fully sharded ranks materialise their
shards only; ``fully_sharded_whole`` builds the whole model first, as before) and run
a few Adam updates on random masked-LM batches; each rank reports the bytes of parameters,
gradients and optimizer state it holds (its shards only), its peak RSS once the model is built and
sharded and over the whole run, and the median update time. Then, from the measured bytes per
parameter of each mode, the largest BERT (layers x hidden) whose training state fits a per-rank
budget. ``uneven`` is fully sharded training on hetfair's uneven engine with equal
``--shard-fractions``: FSDP2's shares, to compare their cost; ``uneven13`` the same engine with the
last rank holding three times each other rank's share (1:3 on two ranks).

    python benchmarks/bench_fsdp.py [--arch bert_base] [--worlds 2,4] [--updates 3] [--budget-gib 1]
                                    [--modes none,os,fully_sharded_whole,fully_sharded,uneven,uneven13]
                                    [--rounds 1]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetfair.bert.criterion import MaskedLmCriterion  # noqa: E402
from hetfair.bert.model import BertConfig, BertModel, bert_base, bert_large, bert_mini  # noqa: E402
from hetfair.memory.peak import peak_bytes  # noqa: E402
from hetfair.models.deferred_init import build_deferred  # noqa: E402
from hetfair.parallel.context import DistributedContext  # noqa: E402
from hetfair.optim.adam import Adam  # noqa: E402
from hetfair.optim.lr_scheduler.fixed import FixedSchedule  # noqa: E402
from hetfair.parallel import ParallelConfig, build_strategy  # noqa: E402
from hetfair.trainer import Trainer, TrainerConfig  # noqa: E402

ARCHS = {"bert_mini": bert_mini, "bert_base": bert_base, "bert_large": bert_large}
MODES = ("none", "os", "fully_sharded_whole", "fully_sharded", "uneven", "uneven13")
VOCAB, LENGTH, BATCH = 30522, 64, 2


def batch(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, VOCAB, (BATCH, LENGTH), generator=generator)
    target = torch.full_like(input_ids, -100)
    masked = torch.rand(BATCH, LENGTH, generator=generator) < 0.15
    target[masked] = input_ids[masked]
    return {"net_input": {"input_ids": input_ids, "token_type_ids": torch.zeros_like(input_ids),
                          "attention_mask": torch.ones_like(input_ids, dtype=torch.bool)},
            "target": target, "nsentences": BATCH, "ntokens": BATCH * LENGTH}


def local_bytes(tensors: list[torch.Tensor]) -> int:
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def worker(rank: int, world: int, port: int, mode: str, arch: str, updates: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    context = DistributedContext(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    options = argparse.Namespace(lr=1e-4, weight_decay=0.0, adam_betas="(0.9, 0.999)", adam_eps=1e-8,
                                 warmup_updates=0, lr_scheduler="fixed", force_anneal=None, lr_shrink=0.1,
                                 optimizer_impl="auto")
    torch.manual_seed(0)
    shares = {"uneven": [1.0] * world, "uneven13": [1.0] * (world - 1) + [3.0]}.get(mode)
    parallel = ParallelConfig("fully_sharded" if mode.startswith(("fully_sharded", "uneven")) else "c10d",
                              zero_sharding="os" if mode == "os" else "none",
                              shard_fractions=tuple(share / sum(shares) for share in shares) if shares else None)
    strategy = build_strategy(parallel, context)

    def build() -> BertModel:
        return BertModel(BertConfig(vocab_size=VOCAB, **ARCHS[arch](), hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0))

    deferred = type(strategy).builds_deferred(parallel) and mode != "fully_sharded_whole"
    model = build_deferred(build) if deferred else build()
    numel = sum(p.numel() for p in model.parameters())  # meta tensors have their sizes too
    trainer = Trainer(TrainerConfig(optimizer="adam"), model, MaskedLmCriterion(None), context, batch(0),
                      optimizer_factory=lambda params: strategy.build_optimizer(Adam, options, params),
                      lr_scheduler_factory=lambda optimizer: FixedSchedule(options, optimizer), strategy=strategy)
    built_rss = peak_bytes(torch.device("cpu"))  # the peak up to here: building and sharding the model
    times = []
    for step in range(updates):
        start = time.perf_counter()
        trainer.train_step([batch(1 + step * world + rank)])
        times.append(time.perf_counter() - start)
    grads = [p.grad for p in trainer.params if p.grad is not None]
    local_optimizer = trainer.optimizer.optim if mode == "os" else trainer.optimizer
    state = [v for s in local_optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    results[(mode, world, rank)] = {
        "params": local_bytes(trainer.params), "grads": local_bytes(grads), "optimizer": local_bytes(state),
        "built_rss": built_rss,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "update_s": statistics.median(times[1:] or times),
        "numel": numel,
    }
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(mode: str, world: int, arch: str, updates: int) -> dict:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(world, free_port(), mode, arch, updates, results), nprocs=world)
        ranks = [results[(mode, world, r)] for r in range(world)]
    return {key: max(r[key] for r in ranks) for key in ranks[0]}  # the fullest rank


def largest_fitting(bytes_per_param: float, budget: float) -> str:
    """The largest (layers x hidden) BERT, hidden 768/1024/1536/2048 and layers 12-96, within ``budget``."""
    best = None
    for hidden in (768, 1024, 1536, 2048):
        for layers in range(12, 97, 12):
            with torch.device("meta"):  # sizes only: no memory, no initialisation
                model = BertModel(BertConfig(VOCAB, hidden, layers, hidden // 64, 4 * hidden))
            numel = sum(p.numel() for p in model.parameters())
            if numel * bytes_per_param <= budget and (best is None or numel > best[0]):
                best = (numel, f"{layers} x {hidden} ({numel / 1e6:.0f}M)")
    return best[1] if best else "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(ARCHS), default="bert_base")
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--budget-gib", type=float, default=2.0, help="per-rank budget for training state")
    parser.add_argument("--modes", default=",".join(MODES), help="the modes to measure (none is always measured: the baseline)")
    parser.add_argument("--rounds", type=int, default=1, help="measure the modes in turn this many times; "
                                                              "report each one's median update time")
    options = parser.parse_args()
    worlds = [int(w) for w in options.worlds.split(",")]
    modes = ["none", *(mode for mode in options.modes.split(",") if mode in MODES and mode != "none")]
    rows = {}
    for world in worlds:
        rounds = [{mode: measure(mode, world, options.arch, options.updates) for mode in modes}  # alternating
                  for _ in range(options.rounds)]
        for mode in modes:
            rows[(mode, world)] = {**rounds[0][mode],
                                   "update_s": statistics.median(r[mode]["update_s"] for r in rounds)}
    mib = 2**20
    print(f"{options.arch}, Adam, batch {BATCH}x{LENGTH} per rank, gloo on CPU, load {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores; per rank (the fullest one), median update time of {options.rounds} round(s)")
    print(f"{'mode':20s}{'ranks':>6s}{'params MiB':>12s}{'grads MiB':>11s}{'optim MiB':>11s}{'state/unsharded':>17s}"
          f"{'built RSS MiB':>15s}{'peak RSS MiB':>14s}{'s/update':>10s}")
    for (mode, world), row in rows.items():
        state = row["params"] + row["grads"] + row["optimizer"]
        base = rows[("none", world)]
        unsharded = base["params"] + base["grads"] + base["optimizer"]
        print(f"{mode:20s}{world:6d}{row['params'] / mib:12.1f}{row['grads'] / mib:11.1f}"
              f"{row['optimizer'] / mib:11.1f}{state / unsharded:17.3f}{row['built_rss'] / mib:15.0f}"
              f"{row['peak_rss'] / mib:14.0f}"
              f"{row['update_s']:10.2f}")
    budget = options.budget_gib * 2**30
    print(f"\nlargest BERT whose parameters + gradients + Adam state fit {options.budget_gib:g} GiB per rank "
          f"(bytes per parameter as measured above):")
    for world in worlds:
        for mode in modes:
            row = rows[(mode, world)]
            per_param = (row["params"] + row["grads"] + row["optimizer"]) / row["numel"]
            print(f"  {mode:20s}{world} ranks: {per_param:5.2f} B/parameter -> {largest_fitting(per_param, budget)}")


if __name__ == "__main__":
    main()

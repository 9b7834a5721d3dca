"""hetfair against a plain DDP loop on N CPU processes (gloo): samples per second.

Contenders, same model, data, per-rank batch size, optimizer and thread count:

* ``plain-torchrun``: DistributedSampler + DataLoader + DDP + Adam, launched by torchrun;
* ``hetfair-torchrun``: ``hetfair-train`` under torchrun (env:// mode, one process per rank);
* ``hetfair-launcher``: ``hetfair-train --distributed-world-size N`` (its own spawning launcher);
* ``plain-spawn``: the plain loop started by ``torch.multiprocessing.spawn``, the way
  hetfair's launcher starts its ranks: the like-for-like baseline of ``hetfair-launcher``.

Why two baselines: torchrun starts every rank in a new session (``setsid``), and
with Linux autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``)
each session gets its own share of a busy CPU; spawned ranks share their
parent's session. On a machine that other jobs keep busy, that alone makes
torchrun-launched ranks faster, whatever they run. CPU time per update does not
depend on it.

Each run is clocked from outside between its first progress line (end of the
warm-up) and its last, so start-up, rendezvous and data loading are excluded.
Contenders alternate (the order rotates every repetition) and the table shows
the median over repetitions, the spread (min..max) and the median of each
repetition's ratio to the plain loop run next to it. Goal: hetfair within 5%.

    .venv/bin/python benchmarks/bench_ddp.py            # full run (several minutes)
    .venv/bin/python benchmarks/bench_ddp.py --quick    # < 60 s
    .venv/bin/python benchmarks/bench_ddp.py --also-tree fix=/tmp/copy   # + hetfair from a copy with a fix
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    DEFAULT_DATA,
    PLAIN_MODELS,
    PLUGIN_DIR,
    REPO_ROOT,
    Samples,
    arch_flags,
    clocked_run,
    data_subset,
    free_port,
    machine_note,
    plain_dataset,
    plain_model,
    print_table,
    progress_line,
    ratio,
    source_trees,
)

LR = 1e-3
SEED = 1
CONFIGS = ("plain-torchrun", "hetfair-torchrun", "plain-spawn", "hetfair-launcher")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="directory of the Fashion-MNIST IDX files")
    parser.add_argument("--model", default="mnist_cnn", choices=sorted(PLAIN_MODELS),
                        help="architecture of the MNIST plugin")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per rank and update")
    parser.add_argument("--ranks", type=int, default=2, help="processes (ranks) on this machine")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every rank, for every contender")
    parser.add_argument("--updates", type=int, default=200, help="timed updates per run")
    parser.add_argument("--interval", type=int, default=20,
                        help="updates per progress line; the first interval is the warm-up")
    parser.add_argument("--repeats", type=int, default=5, help="runs per contender")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {', '.join(CONFIGS)}")
    parser.add_argument("--train-size", type=int, default=0,
                        help="use only the first N training images (shorter start-up; 0: all)")
    parser.add_argument("--also-tree", action="append", default=[], metavar="LABEL=PATH",
                        help="also run hetfair from the source tree PATH (e.g. a copy with a proposed fix), "
                             "reported as CONTENDER[LABEL]; repeatable")
    parser.add_argument("--hetfair-variant", action="append", default=[], metavar="LABEL=FLAGS",
                        help="also run hetfair-train under torchrun with these extra flags (e.g. "
                             "'cap5=--bucket-cap-mb 5'), reported as hetfair-torchrun[LABEL]; repeatable")
    parser.add_argument("--quick", action="store_true", help="small sizes: finishes in under a minute")
    parser.add_argument("--worker", choices=("plain-ddp", "plain-spawn"), help=argparse.SUPPRESS)
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.updates, args.interval, args.repeats = "mnist_cnn_small", 40, 10, 1
        args.train_size = args.train_size or 8192
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown --configs {', '.join(sorted(unknown))}; choose from {', '.join(CONFIGS)}")
    return args


# -- the plain DDP loop (one rank of it, started by torchrun or spawn) ------------------------
def plain_ddp_worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)
    dataset = plain_dataset(args.data)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=SEED, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model = DistributedDataParallel(plain_model(args.model))
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    if args.compile:
        model = torch.compile(model)
    total = args.interval + args.updates
    updates, epoch, started = 0, 0, time.perf_counter()
    while updates < total:
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
            updates += 1
            if updates % args.interval == 0 and rank == 0:
                now = time.perf_counter()
                print(progress_line(updates, now - started, args.interval), flush=True)
                started = now
            if updates == total:
                break
        epoch += 1
    dist.destroy_process_group()


def _spawned_plain_rank(index: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(RANK=str(index), LOCAL_RANK=str(index), WORLD_SIZE=str(args.ranks),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    plain_ddp_worker(args)


def plain_spawn_launcher(args: argparse.Namespace) -> None:
    """Start the plain ranks like hetfair's launcher does: ``torch.multiprocessing.spawn``."""
    import torch.multiprocessing as mp

    mp.spawn(_spawned_plain_rank, args=(args, free_port()), nprocs=args.ranks, join=True)


# -- contenders ---------------------------------------------------------------------------
@dataclass
class Contender:
    name: str
    command: list[str]
    env: dict[str, str]
    cwd: Path
    baseline: str | None = None
    wall: Samples = field(default_factory=Samples)
    cpu: Samples = field(default_factory=Samples)
    own: Samples = field(default_factory=Samples)


def torchrun(ranks: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]


def hetfair_options(args: argparse.Namespace, save_dir: Path, plugin_dir: Path = PLUGIN_DIR) -> list[str]:
    return ["--user-dir", str(plugin_dir), "--task", "mnist", "--data", str(args.data), *arch_flags(args.model),
            "--cpu", "--max-sentences", str(args.batch_size), "--optimizer", "adam", "--lr", str(LR),
            "--seed", str(SEED), "--max-epoch", "0", "--max-update", str(args.interval + args.updates),
            "--log-format", "json", "--log-interval", str(args.interval), "--disable-validation", "--no-save",
            "--save-dir", str(save_dir)]


def contenders(args: argparse.Namespace, save_dir: Path) -> list[Contender]:
    """The chosen contenders; hetfair's once per source tree (this one and every ``--also-tree``)."""
    script = str(Path(__file__).resolve())
    plain = ["--data", str(args.data), "--model", args.model, "--batch-size", str(args.batch_size),
             "--updates", str(args.updates), "--interval", str(args.interval), "--ranks", str(args.ranks)]
    chosen = args.configs.split(",")
    trees = source_trees(args.also_tree, "bench_ddp")
    result = []
    for name in chosen:
        if name.startswith("plain"):
            command = ([*torchrun(args.ranks), script, "--worker", "plain-ddp", *plain] if name == "plain-torchrun"
                       else [sys.executable, script, "--worker", "plain-spawn", *plain])
            result.append(Contender(name, command, trees[0].env(args.threads), REPO_ROOT))
            continue
        like = "plain-spawn" if name == "hetfair-launcher" else "plain-torchrun"
        baseline = next((c for c in (like, "plain-torchrun", "plain-spawn") if c in chosen), None)
        for tree in trees:
            hetfair = ["-m", "hetfair_cli.train", *hetfair_options(args, save_dir, tree.plugin_dir)]
            command = ([*torchrun(args.ranks), *hetfair] if name == "hetfair-torchrun"
                       else [sys.executable, *hetfair, "--distributed-world-size", str(args.ranks)])
            result.append(Contender(tree.tag(name), command, tree.env(args.threads), tree.root, baseline))
    for spec in args.hetfair_variant:
        label, _, flags = spec.partition("=")
        command = [*torchrun(args.ranks), "-m", "hetfair_cli.train", *hetfair_options(args, save_dir), *flags.split()]
        baseline = "plain-torchrun" if "plain-torchrun" in chosen else None
        result.append(Contender(f"hetfair-torchrun[{label}]", command, trees[0].env(args.threads), REPO_ROOT,
                                baseline))
    return result


def rotated(items: list[Contender], by: int) -> list[Contender]:
    by %= len(items)
    return items[by:] + items[:by]


# -- measuring and reporting ------------------------------------------------------------------
def measure(args: argparse.Namespace, runs: list[Contender]) -> None:
    samples_per_update = args.batch_size * args.ranks
    total = args.interval + args.updates
    for rep in range(args.repeats):
        for contender in rotated(runs, rep):
            run = clocked_run(contender.command, contender.env, timeout=900, expected_updates=total,
                              cwd=contender.cwd)
            contender.wall.add(run.wall_per_update)
            contender.cpu.add(run.cpu_per_update)
            contender.own.add(run.self_reported_per_update)
            print(f"  rep {rep + 1}/{args.repeats} {contender.name:22s} "
                  f"{samples_per_update / run.wall_per_update:7.0f} samples/s  ({run.wall_per_update * 1e3:.1f} "
                  f"ms/update, cpu {run.cpu_per_update * 1e3:.1f} ms, run {run.total_wall:.0f} s)", flush=True)


def report(args: argparse.Namespace, runs: list[Contender]) -> None:
    samples_per_update = args.batch_size * args.ranks
    by_name = {c.name: c for c in runs}
    rows = []
    for contender in runs:
        throughput = Samples([samples_per_update / t for t in contender.wall.values])
        row = [contender.name, f"{throughput.median:.0f}", throughput.spread("{:.0f}"),
               f"{contender.wall.median * 1e3:.1f}", f"{samples_per_update / contender.own.median:.0f}",
               f"{contender.cpu.median * 1e3:.1f}"]
        base = by_name.get(contender.baseline or "")
        if base is not None:
            speed = Samples([ratio(b, a) for a, b in zip(contender.wall.values, base.wall.values)])
            cost = Samples([ratio(a, b) for a, b in zip(contender.cpu.values, base.cpu.values)])
            row += [base.name, f"{speed.median:.3f}", speed.spread("{:.2f}"), f"{cost.median:.3f}",
                    cost.spread("{:.2f}"), f"{(contender.cpu.median - base.cpu.median) * 1e3 / args.ranks:+.2f}"]
        else:
            row += ["-"] * 6
        rows.append(row)
    print_table(
        f"{args.ranks} CPU ranks, gloo, {args.model}, {args.batch_size}/rank, OMP_NUM_THREADS={args.threads}: "
        f"{args.updates} updates after {args.interval} warm-up, {args.repeats} runs each (median, min..max)",
        ["contender", "samples/s", "spread", "ms/update", "own samples/s", "cpu ms/update", "baseline",
         "speed vs base", "spread", "cpu vs base", "spread", "extra cpu ms/rank"],
        rows,
        notes=["speed vs base = baseline time / contender time in the same repetition (1.0 = as fast; goal >= 0.95);",
               "  baseline: the plain loop started the same way (torchrun, or spawn like hetfair's launcher)",
               "cpu = CPU seconds of all ranks (and launcher processes) per update; 'own' = from the run's own "
               "ups metric"])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker == "plain-ddp":
        plain_ddp_worker(args)
        return
    if args.worker == "plain-spawn":
        plain_spawn_launcher(args)
        return
    print(f"bench_ddp: {machine_note()}; {args.ranks} ranks x OMP_NUM_THREADS={args.threads}; model {args.model}, "
          f"{args.batch_size} samples per rank; hetfair from {REPO_ROOT}",
          flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_ddp_") as tmp:
        args.data = data_subset(args.data, args.train_size, Path(tmp) / "data")
        runs = contenders(args, Path(tmp))
        measure(args, runs)
    report(args, runs)
    print(f"\nbench_ddp finished in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()

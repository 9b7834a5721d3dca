"""hetfair's updates against a plain PyTorch loop, one CPU process.

Two measurements, same model, data and batch size on both sides:

1. in process: ``Trainer.train_step([batch])`` against ``zero_grad / forward /
   mean cross-entropy / backward / step`` on the same pre-collated batches;
   blocks of updates alternate between the two, after a warm-up;
2. end to end: ``hetfair-train`` (``python -m hetfair_cli.train``) against a
   plain script with a ``DataLoader(shuffle=True)``, both as subprocesses
   clocked between their first and last progress lines (start-up and warm-up
   excluded).

Times are per update: wall clock and CPU seconds (the CPU time is the steadier
number on a shared machine). Ratios are hetfair / plain, the median of the
ratios of adjacent runs; the goal is <= 1.05.

    .venv/bin/python benchmarks/bench_trainer.py            # full run (a few minutes)
    .venv/bin/python benchmarks/bench_trainer.py --quick    # < 60 s
    .venv/bin/python benchmarks/bench_trainer.py --profile 200   # + where hetfair's time goes
    .venv/bin/python benchmarks/bench_trainer.py --also-tree fix=/tmp/copy   # + hetfair-train of a copy

The in-process part uses the hetfair next to this file (run the script from a
copy of the repository to time a modified Trainer in process); the end-to-end
part can add the ``hetfair-train`` of other source trees (``--also-tree``),
measured in the same alternation as the others.

The default of one torch thread keeps a shared machine from over-subscribing
(two spinning OpenMP threads per process triple the wall time under load); the
comparison holds for ``--threads 2`` on a quiet machine as well.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
import timeit
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    DEFAULT_DATA,
    PLUGIN_DIR,
    REPO_ROOT,
    Samples,
    arch_flags,
    clocked_run,
    data_subset,
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="directory of the Fashion-MNIST IDX files")
    parser.add_argument("--models", default="mnist_cnn,mnist_mlp",
                        help="comma-separated architectures of the MNIST plugin")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (OMP_NUM_THREADS of the subprocesses); 1 keeps a "
                             "shared machine from over-subscribing")
    parser.add_argument("--warmup", type=int, default=10, help="in-process updates before timing each contender")
    parser.add_argument("--block", type=int, default=20, help="in-process updates per timed block")
    parser.add_argument("--repeats", type=int, default=9, help="in-process timed blocks per contender")
    parser.add_argument("--e2e-models", default=None, help="architectures for the end-to-end runs (default: --models)")
    parser.add_argument("--e2e-updates", type=int, default=300, help="timed updates per end-to-end run")
    parser.add_argument("--e2e-interval", type=int, default=20,
                        help="updates per progress line; the first interval is the warm-up")
    parser.add_argument("--e2e-repeats", type=int, default=3, help="end-to-end runs per contender")
    parser.add_argument("--no-e2e", action="store_true", help="skip the end-to-end runs")
    parser.add_argument("--also-tree", action="append", default=[], metavar="LABEL=PATH",
                        help="end to end, also run hetfair-train from the source tree PATH (e.g. a copy with a "
                             "proposed fix), reported as hetfair-train[LABEL]; repeatable")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also profile N hetfair updates of the first model and time the trainer's extras")
    parser.add_argument("--train-size", type=int, default=0,
                        help="use only the first N training images (shorter start-up; 0: all)")
    parser.add_argument("--quick", action="store_true", help="small sizes: finishes in under a minute")
    parser.add_argument("--worker", choices=("plain-e2e",), help=argparse.SUPPRESS)
    parser.add_argument("--arch", help=argparse.SUPPRESS)
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--updates", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.block, args.warmup = 3, 10, 5
        args.e2e_updates, args.e2e_interval, args.e2e_repeats = 60, 20, 1
        args.train_size = args.train_size or 8192
    return args


# -- the two contenders, in process ----------------------------------------------------------
@dataclass
class Contender:
    name: str
    step: Callable[[dict[str, Any]], None]
    wall: Samples = field(default_factory=Samples)
    cpu: Samples = field(default_factory=Samples)


def hetfair_args(arch: str, data: Path, batch_size: int, *extra: str, plugin_dir: Path = PLUGIN_DIR) -> list[str]:
    return ["--user-dir", str(plugin_dir), "--task", "mnist", "--data", str(data), *arch_flags(arch), "--cpu",
            "--max-sentences", str(batch_size), "--optimizer", "adam", "--lr", str(LR), "--seed", str(SEED),
            "--disable-validation", "--no-save", *extra]


def build_contenders(arch: str, args: argparse.Namespace) -> tuple[list[Contender], Any, list[dict[str, Any]]]:
    """The plain loop with torch's default optimizer implementation, the same loop with the fused step
    hetfair uses by default, and hetfair's Trainer; same initial weights; plus a pool of batches."""
    from hetfair.data.rank_batches import dummy_batch
    from hetfair.parallel.context import DistributedContext
    from hetfair.options import parse_train_args
    from hetfair.tasks import TASK_REGISTRY
    from hetfair.run.wiring import build_trainer

    options = parse_train_args(hetfair_args(arch, args.data, args.batch_size, "--log-format", "none"))
    task = TASK_REGISTRY.get(options.task).setup_task(options)
    dataset = task.dataset(options.train_subset)
    torch.manual_seed(SEED)
    model = task.build_model(options)
    context = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    trainer = build_trainer(options, model, task.build_criterion(options), context,
                            dummy_batch(dataset, task.collater))

    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(SEED)).tolist()
    pool = [task.collater([dataset[i] for i in order[k * args.batch_size:(k + 1) * args.batch_size]])
            for k in range(32)]

    def plain_loop(**optimizer_kwargs: Any) -> Callable[[dict[str, Any]], None]:
        plain = plain_model(arch)
        plain.load_state_dict(model.state_dict())
        plain.train()
        optimizer = torch.optim.Adam(plain.parameters(), lr=LR, **optimizer_kwargs)

        def plain_step(batch: dict[str, Any]) -> None:
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(plain(batch["net_input"]["x"]), batch["target"])
            loss.backward()
            optimizer.step()

        return plain_step

    def hetfair_step(batch: dict[str, Any]) -> None:
        trainer.train_step([batch])

    contenders = [Contender("plain", plain_loop()), Contender("plain, fused step", plain_loop(fused=True)),
                  Contender("hetfair", hetfair_step)]
    return contenders, trainer, pool


def run_block(contender: Contender, pool: list[dict[str, Any]], count: int, offset: int) -> None:
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(count):
        contender.step(pool[(offset + i) % len(pool)])
    contender.wall.add((time.perf_counter() - wall) / count)
    contender.cpu.add((time.process_time() - cpu) / count)


def paired_ratio(numerator: Samples, denominator: Samples) -> Samples:
    return Samples([ratio(a, b) for a, b in zip(numerator.values, denominator.values)])


def bench_in_process(args: argparse.Namespace, models: list[str]) -> list[list[str]]:
    """One row per model and baseline: hetfair's time per update against each plain loop's."""
    rows = []
    for arch in models:
        contenders, _, pool = build_contenders(arch, args)
        for contender in contenders:
            for i in range(args.warmup):
                contender.step(pool[i % len(pool)])
        for rep in range(args.repeats):
            for contender in contenders if rep % 2 == 0 else contenders[::-1]:
                run_block(contender, pool, args.block, rep * args.block)
        *baselines, hetfair = contenders
        for plain in baselines:
            wall_ratio, cpu_ratio = paired_ratio(hetfair.wall, plain.wall), paired_ratio(hetfair.cpu, plain.cpu)
            extra = Samples([h - p for h, p in zip(hetfair.cpu.values, plain.cpu.values)])
            rows.append([
                f"{arch} (bs {args.batch_size})", plain.name,
                f"{plain.wall.median * 1e3:.2f}", plain.wall.spread("{:.1f}", scale=1e3),
                f"{hetfair.wall.median * 1e3:.2f}", hetfair.wall.spread("{:.1f}", scale=1e3),
                f"{wall_ratio.median:.3f}",
                f"{plain.cpu.median * 1e3:.2f}", f"{hetfair.cpu.median * 1e3:.2f}",
                f"{cpu_ratio.median:.3f}", cpu_ratio.spread("{:.2f}"),
                f"{extra.median * 1e6:+.0f}",
            ])
    return rows


# -- end to end: hetfair-train against a plain script --------------------------------------
def plain_e2e_worker(args: argparse.Namespace) -> None:
    """The plain loop as its own process: DataLoader, model, Adam; a progress line every interval."""
    torch.manual_seed(SEED)
    dataset = plain_dataset(args.data)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True)
    model = plain_model(args.arch)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    if args.compile:
        model = torch.compile(model)
    updates, started = 0, time.perf_counter()
    while updates < args.updates:
        for inputs, targets in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
            updates += 1
            if updates % args.e2e_interval == 0:
                now = time.perf_counter()
                print(progress_line(updates, now - started, args.e2e_interval), flush=True)
                started = now
            if updates == args.updates:
                break


@dataclass
class Run:
    """One end-to-end contender: its command, environment, working directory and measurements."""

    name: str
    command: list[str]
    env: dict[str, str]
    cwd: Path
    wall: Samples = field(default_factory=Samples)
    cpu: Samples = field(default_factory=Samples)
    own: Samples = field(default_factory=Samples)


def e2e_runs(arch: str, args: argparse.Namespace, save_dir: Path) -> list[Run]:
    total = args.e2e_interval + args.e2e_updates
    plain = [sys.executable, str(Path(__file__).resolve()), "--worker", "plain-e2e", "--arch", arch,
             "--data", str(args.data), "--batch-size", str(args.batch_size), "--updates", str(total),
             "--e2e-interval", str(args.e2e_interval), "--threads", str(args.threads)]
    trees = source_trees(args.also_tree, "bench_trainer")
    runs = [Run("plain", plain, trees[0].env(args.threads), REPO_ROOT)]
    for tree in trees:
        hetfair = [sys.executable, "-m", "hetfair_cli.train",
                   *hetfair_args(arch, args.data, args.batch_size, "--max-epoch", "0", "--max-update", str(total),
                                 "--log-format", "json", "--log-interval", str(args.e2e_interval),
                                 "--save-dir", str(save_dir), plugin_dir=tree.plugin_dir)]
        runs.append(Run(tree.tag("hetfair-train"), hetfair, tree.env(args.threads), tree.root))
    return runs


def bench_end_to_end(args: argparse.Namespace, models: list[str]) -> list[list[str]]:
    rows = []
    total = args.e2e_interval + args.e2e_updates
    with tempfile.TemporaryDirectory(prefix="bench_trainer_") as tmp:
        for arch in models:
            runs = e2e_runs(arch, args, Path(tmp))
            for rep in range(args.e2e_repeats):
                shift = rep % len(runs)
                for run in runs[shift:] + runs[:shift]:
                    result = clocked_run(run.command, run.env, timeout=900, expected_updates=total, cwd=run.cwd)
                    run.wall.add(result.wall_per_update)
                    run.cpu.add(result.cpu_per_update)
                    run.own.add(result.self_reported_per_update)
            plain = runs[0]
            for run in runs:
                rows.append([
                    f"{arch} (bs {args.batch_size})", run.name,
                    f"{run.wall.median * 1e3:.2f}", run.wall.spread("{:.1f}", scale=1e3),
                    f"{run.own.median * 1e3:.2f}", f"{args.batch_size / run.wall.median:.0f}",
                    f"{paired_ratio(run.wall, plain.wall).median:.3f}",
                    f"{run.cpu.median * 1e3:.2f}",
                    f"{paired_ratio(run.cpu, plain.cpu).median:.3f}", paired_ratio(run.cpu, plain.cpu).spread("{:.2f}"),
                    f"{(run.cpu.median - plain.cpu.median) * 1e6:+.0f}",
                ])
    return rows


# -- where the time goes ------------------------------------------------------------------
def profile_trainer(args: argparse.Namespace, arch: str) -> None:
    contenders, trainer, pool = build_contenders(arch, args)
    hetfair = contenders[-1]
    for i in range(args.warmup):
        hetfair.step(pool[i % len(pool)])
    profiler = cProfile.Profile(timer=time.process_time)
    profiler.enable()
    for i in range(args.profile):
        hetfair.step(pool[i % len(pool)])
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(25)
    print(f"\ncProfile of {args.profile} Trainer.train_step calls ({arch}), by cumulative CPU time:")
    print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:6000])
    print_table(f"Trainer extras beyond a plain update, timed alone ({arch}; us per call)",
                ["operation (once per micro-batch / update)", "us"], trainer_extras(trainer, pool[0]),
                notes=["timed alone, with the gradients in cache: inside an update the gradient norm costs more",
                       "the normalisation by the global sample count is folded into the fused step (grad_scale)"])


def trainer_extras(trainer: Any, batch: dict[str, Any]) -> list[list[str]]:
    from hetfair.trainer import _seed_rng
    from hetfair.utils import derived_seed, move_to_device

    grads = [p.grad for p in trainer.params if p.grad is not None]
    logits = trainer.model(batch["net_input"]["x"]).detach()
    target = batch["target"]
    cpu = torch.device("cpu")
    cases: dict[str, Callable[[], Any]] = {
        "seed the generators: _seed_rng(derived_seed(seed, update, index, rank))":
            lambda: _seed_rng(derived_seed(SEED, 5, 0, 0), cpu),
        "move_to_device(batch) (CPU: no copy)": lambda: move_to_device(batch, cpu),
        "gradient norm (foreach_norm, stack, vector_norm, float)": lambda: trainer._clip_grad_norm(grads, 1.0),
        "criterion logs: float(loss), argmax accuracy": lambda: (
            float(F.cross_entropy(logits, target, reduction="sum")), float((logits.argmax(-1) == target).sum())),
        "stats of one process: start and wait (no collective)": lambda: trainer._start_stats_sync(
            {"loss": 1.0}, len(target)).wait(),
        "plain: F.cross_entropy(logits, target) (for scale)": lambda: F.cross_entropy(logits, target),
    }
    rows = []
    for name, case in cases.items():
        number = 300
        best = min(timeit.repeat(case, number=number, repeat=5, timer=time.process_time)) / number
        rows.append([name, f"{best * 1e6:.1f}"])
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker == "plain-e2e":
        plain_e2e_worker(args)
        return
    models = [m for m in args.models.split(",") if m]
    e2e_models = [m for m in (args.e2e_models or args.models).split(",") if m]
    print(f"bench_trainer: {machine_note()}; {args.threads} thread(s); hetfair from {REPO_ROOT}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_trainer_data_") as tmp:
        args.data = data_subset(args.data, args.train_size, Path(tmp))
        run_benchmarks(args, models, e2e_models)
    print(f"\nbench_trainer finished in {time.perf_counter() - started:.0f} s")


def run_benchmarks(args: argparse.Namespace, models: list[str], e2e_models: list[str]) -> None:
    rows = bench_in_process(args, models)
    print_table(
        f"Per update, in process: Trainer.train_step vs plain loop ({args.repeats} x {args.block} updates each, "
        f"alternating, after {args.warmup} warm-up; median, min..max)",
        ["model", "plain loop", "plain ms", "spread", "hetfair ms", "spread", "ratio wall",
         "plain cpu ms", "hetfair cpu ms", "ratio cpu", "spread", "extra cpu us"],
        rows,
        notes=["ratio = median over repetitions of hetfair/plain of adjacent blocks; goal <= 1.05",
               "cpu = process CPU time per update: steadier than wall time on a shared machine",
               "extra cpu us = median over repetitions of hetfair's minus the plain loop's CPU time per update",
               "plain: torch.optim.Adam's default (per-parameter loop on CPU); plain, fused step: Adam(fused=True), "
               "hetfair's default (--optimizer-impl auto)"])
    if not args.no_e2e:
        rows = bench_end_to_end(args, e2e_models)
        print_table(
            f"Per update, end to end: hetfair-train vs plain DataLoader loop ({args.e2e_repeats} runs each, "
            f"alternating; {args.e2e_updates} updates after {args.e2e_interval} warm-up; median, min..max)",
            ["model", "contender", "wall ms", "spread", "own ms", "samples/s", "ratio wall", "cpu ms", "ratio cpu",
             "spread", "extra cpu us"],
            rows,
            notes=["wall: clocked by this script between progress lines; own: from the run's own ups metric",
                   "cpu: CPU seconds of the process per update; ratios: median of hetfair/plain of adjacent runs"])
    if args.profile:
        profile_trainer(args, models[0])


if __name__ == "__main__":
    main()

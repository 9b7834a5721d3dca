"""hetfair-train against the plain PyTorch loop a user would write, on the same jobs, in one run.

Workloads: the peers' Fashion-MNIST CNN (two convolutions, dropout 0.5), the
MNIST plugin's ``mnist_cnn``, its tiny MLP (``mnist_mlp``, ~1 ms per update) and
BERT (``bert_mini`` on the Jargon File, dynamic masking, end to end). Each runs
on 1 process (2 threads) and on 2 ranks (1 thread each, gloo, both launched by
torchrun), eager and compiled:

* ``plain``: DataLoader + model + ``torch.optim`` with its defaults (+ DDP with a
  DistributedSampler on 2 ranks), a progress line every interval; with
  ``--compile`` the model is wrapped in ``torch.compile``;
* ``hetfair``: ``hetfair-train`` on the same data, model, batch size and
  optimizer (its defaults: fused optimizer step), with ``--compile`` for the
  compiled column.

The plain contenders are the workers of ``bench_trainer.py`` (1 process),
``bench_ddp.py`` (2 ranks) and ``bench_bert.py``. Every run is clocked from
outside between its first progress line (the end of the warm-up, which holds
compiling) and its last; contenders of one cell run next to each other, their
order rotating every repetition. Speed = plain time / hetfair time per update
(median of the repetitions' ratios; > 1: hetfair is faster).

    .venv/bin/python benchmarks/bench_vs_plain.py            # full run (about an hour on 2 busy cores)
    .venv/bin/python benchmarks/bench_vs_plain.py --quick    # a few minutes: small sizes, 1 repetition
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_ddp import torchrun  # noqa: E402
from benchmarks.bench_trainer import hetfair_args  # noqa: E402
from benchmarks.common import (  # noqa: E402
    DEFAULT_DATA,
    REPO_ROOT,
    Samples,
    clocked_run,
    data_subset,
    machine_note,
    print_table,
    ratio,
    subprocess_env,
)

BENCHMARKS = Path(__file__).resolve().parent
MODES = ("eager", "compile")


@dataclass(frozen=True)
class Workload:
    name: str
    model: str
    batch_size: int
    """Samples per update over all ranks."""
    updates: int
    interval: int

    @property
    def is_bert(self) -> bool:
        return self.model.startswith("bert")


WORKLOADS = (
    Workload("peers' CNN (dropout)", "mnist_cnn_dropout", 64, 200, 20),
    Workload("mnist_cnn", "mnist_cnn", 64, 200, 20),
    Workload("tiny MLP", "mnist_mlp", 64, 600, 50),
    Workload("BERT mini e2e", "bert_mini", 32, 20, 5),
)


@dataclass
class Contender:
    name: str
    command: list[str]
    env: dict[str, str]
    wall: Samples = field(default_factory=Samples)


@dataclass
class Cell:
    """One workload on one cluster shape: plain and hetfair, eager and compiled."""

    workload: Workload
    ranks: int
    contenders: dict[str, Contender] = field(default_factory=dict)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="directory of the Fashion-MNIST IDX files")
    parser.add_argument("--workloads", default=",".join(w.model for w in WORKLOADS),
                        help="comma-separated subset of " + ", ".join(w.model for w in WORKLOADS))
    parser.add_argument("--ranks", default="1,2", help="cluster shapes: processes per run")
    parser.add_argument("--modes", default=",".join(MODES), help="eager, compile or both")
    parser.add_argument("--repeats", type=int, default=3, help="runs per contender")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every workload's timed updates")
    parser.add_argument("--no-plain-compile", action="store_true",
                        help="compiled column: compare hetfair --compile with the eager plain loop only")
    parser.add_argument("--single-threads", type=int, default=2, help="threads of a one-process run")
    parser.add_argument("--bert-workers", type=int, default=1,
                        help="DataLoader workers of both BERT contenders (hetfair-train --num-workers)")
    parser.add_argument("--train-size", type=int, default=0,
                        help="use only the first N Fashion-MNIST training images (shorter start-up; 0: all)")
    parser.add_argument("--workdir", type=Path, help="keep the preprocessed BERT data here (default: temporary)")
    parser.add_argument("--quick", action="store_true", help="a few minutes: fewer updates, 1 repetition")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.scale = 1, 0.3
        args.train_size = args.train_size or 8192
    return args


# -- commands --------------------------------------------------------------------------------
def plain_command(w: Workload, ranks: int, compiled: bool, data: Path, bert_dir: Path, workers: int) -> list[str]:
    total = w.interval + w.updates
    per_rank = str(w.batch_size // ranks)
    if w.is_bert:
        worker = [str(BENCHMARKS / "bench_bert.py"), "--plain-e2e", "--arch", w.model, "--batch", per_rank,
                  "--updates", str(total), "--interval", str(w.interval), "--threads", str(threads(ranks)),
                  "--workdir", str(bert_dir), "--num-workers", str(workers)]
    elif ranks == 1:
        worker = [str(BENCHMARKS / "bench_trainer.py"), "--worker", "plain-e2e", "--arch", w.model, "--data", str(data),
                  "--batch-size", per_rank, "--updates", str(total), "--e2e-interval", str(w.interval),
                  "--threads", str(threads(ranks))]
    else:
        worker = [str(BENCHMARKS / "bench_ddp.py"), "--worker", "plain-ddp", "--model", w.model, "--data", str(data),
                  "--batch-size", per_rank, "--updates", str(w.updates), "--interval", str(w.interval),
                  "--ranks", str(ranks)]
    return launcher(ranks) + worker + (["--compile"] if compiled else [])


def hetfair_command(w: Workload, ranks: int, compiled: bool, data: Path, bert_dir: Path, workers: int,
                    save_dir: Path) -> list[str]:
    total = str(w.interval + w.updates)
    per_rank = w.batch_size // ranks
    logging = ["--log-format", "json", "--log-interval", str(w.interval)]
    if w.is_bert:
        from benchmarks.bench_bert import train_flags

        flags = [*train_flags(bert_dir / "data", w.model, per_rank, int(total), save_dir),
                 "--num-workers", str(workers), "--cpu", *logging]
    else:
        flags = hetfair_args(w.model, data, per_rank, "--max-epoch", "0", "--max-update", total, *logging,
                             "--save-dir", str(save_dir))
    return launcher(ranks) + ["-m", "hetfair_cli.train", *flags] + (["--compile"] if compiled else [])


def launcher(ranks: int) -> list[str]:
    return [sys.executable] if ranks == 1 else torchrun(ranks)


THREADS = {1: 2}
"""Threads of a one-process run (``--single-threads``); every rank of a 2-rank run has 1 (two cores)."""


def threads(ranks: int) -> int:
    return THREADS.get(ranks, 1)


def build_cells(args: argparse.Namespace, bert_dir: Path, save_dir: Path) -> list[Cell]:
    chosen = args.workloads.split(",")
    cells = []
    for w in WORKLOADS:
        if w.model not in chosen:
            continue
        intervals = max(2, round(w.updates * args.scale / w.interval))  # whole intervals: the last line ends the run
        w = Workload(w.name, w.model, w.batch_size, intervals * w.interval, w.interval)
        for ranks in (int(r) for r in args.ranks.split(",")):
            cell = Cell(w, ranks)
            env = subprocess_env(threads(ranks), str(REPO_ROOT))
            for mode in args.modes.split(","):
                compiled = mode == "compile"
                suffix = " --compile" if compiled else ""
                if not (compiled and args.no_plain_compile):
                    cell.contenders["plain" + suffix] = Contender(
                        "plain" + suffix, plain_command(w, ranks, compiled, args.data, bert_dir, args.bert_workers),
                        env)
                cell.contenders["hetfair" + suffix] = Contender(
                    "hetfair" + suffix,
                    hetfair_command(w, ranks, compiled, args.data, bert_dir, args.bert_workers, save_dir), env)
            cells.append(cell)
    return cells


# -- measuring and reporting ------------------------------------------------------------------
def measure(args: argparse.Namespace, cells: list[Cell]) -> None:
    for rep in range(args.repeats):
        for cell in cells:
            runs = list(cell.contenders.values())
            shift = rep % len(runs)
            for contender in runs[shift:] + runs[:shift]:
                total = cell.workload.interval + cell.workload.updates
                run = clocked_run(contender.command, contender.env, timeout=1800, expected_updates=total,
                                  cwd=REPO_ROOT)
                contender.wall.add(run.wall_per_update)
                print(f"  rep {rep + 1}/{args.repeats} {cell.workload.name:22s} {cell.ranks} rank(s) "
                      f"{contender.name:18s} {run.wall_per_update * 1e3:8.1f} ms/update  (run {run.total_wall:.0f} s)",
                      flush=True)


def speed(base: Contender | None, other: Contender | None) -> str:
    """Median over repetitions of base time / other time (> 1: ``other`` is faster)."""
    if base is None or other is None:
        return "-"
    ratios = Samples([ratio(b, o) for b, o in zip(base.wall.values, other.wall.values)])
    return f"{ratios.median:.3f} ({ratios.spread()})" if len(ratios.values) > 1 else f"{ratios.median:.3f}"


def report(args: argparse.Namespace, cells: list[Cell]) -> None:
    rows = []
    for cell in cells:
        c = cell.contenders.get
        ms = [f"{c(name).wall.median * 1e3:.1f}" if c(name) else "-"
              for name in ("plain", "hetfair", "plain --compile", "hetfair --compile")]
        rows.append([cell.workload.name, f"{cell.ranks} x {cell.workload.batch_size // cell.ranks}", *ms,
                     speed(c("plain"), c("hetfair")), speed(c("plain --compile"), c("hetfair --compile")),
                     speed(c("plain"), c("hetfair --compile"))])
    print_table(
        f"ms per update, median of {args.repeats} run(s) each; speed = plain time / hetfair time "
        f"(> 1: hetfair faster), median (min..max) of the repetitions' ratios",
        ["workload", "ranks x batch", "plain", "hetfair", "plain compiled", "hetfair --compile",
         "speed eager", "speed compiled", "hetfair --compile vs plain eager"],
        rows,
        notes=["plain: torch.optim defaults (the per-parameter loop on CPU); hetfair: its defaults (fused step)",
               f"BERT: both with {args.bert_workers} DataLoader worker(s); 2 ranks: torchrun, gloo, 1 thread each"])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    THREADS[1] = args.single_threads
    print(f"bench_vs_plain: {machine_note()}; hetfair from {REPO_ROOT}; 1 process x {args.single_threads} "
          f"thread(s), 2 ranks x 1", flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_vs_plain_") as tmp:
        args.data = data_subset(args.data, args.train_size, Path(tmp) / "mnist")
        bert_dir = args.workdir or Path(tmp) / "bert"
        if any(w.is_bert and w.model in args.workloads.split(",") for w in WORKLOADS):
            from benchmarks.bench_bert import prepare_data

            prepare_data(bert_dir)
        cells = build_cells(args, bert_dir, Path(tmp) / "ckpt")
        measure(args, cells)
    report(args, cells)
    print(f"\nbench_vs_plain finished in {time.perf_counter() - started:.0f} s; {machine_note()}")


if __name__ == "__main__":
    main()

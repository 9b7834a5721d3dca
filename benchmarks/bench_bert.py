"""Throughput of hetfair's BERT updates against a plain PyTorch loop on the same model and batches.

Variants, each on identical pre-collated batches from the Jargon File (or a
synthetic corpus when the ``jargon-text`` package is missing):

* ``plain``: mean ``F.cross_entropy`` over the masked tokens, ``backward``, clip,
  AdamW step, schedule;
* ``trainer``: ``hetfair.trainer.Trainer.train_step`` (criterion, stats sync,
  gradient normalisation, clip, step, schedule);
* ``hetfair-train``: the whole command (DataLoader, masking, logging) on the same
  data in its own order; the median of its own per-update ``wps`` after the warm-up
  (``--log-interval 1``; the mean over all updates, which earlier versions took,
  also counted the slow first updates).

Tokens/s are medians over updates. ``plain`` and ``trainer`` alternate update by
update inside one process, so both see the same machine load (the ratio is the
number to trust on a shared machine); peak RSS comes from separate processes
running one variant each. Usage: ``python benchmarks/bench_bert.py [--arch bert_mini]``
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from hetfair.parallel.context import DistributedContext
from hetfair.options import parse_train_args
from hetfair.tasks import TASK_REGISTRY
from hetfair.run.wiring import build_trainer
from hetfair_cli.preprocess import main as preprocess_main
from hetfair_cli.train import main as train_main

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import progress_line  # noqa: E402

JARGON = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
WARMUP_UPDATES = 3
Step = Callable[[dict], None]


def prepare_data(workdir: Path) -> Path:
    """Preprocess the Jargon File (or a synthetic text) into ``workdir/data``."""
    data = workdir / "data"
    if (data / "train.idx").exists():
        return data
    workdir.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from pretrain_bert_jargon import write_splits

    if JARGON.is_file():
        train, _ = write_splits(JARGON, workdir)
    else:
        words = "the hacker wrote code for machines and networks while users read manuals".split()
        lines = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) + "." for i in range(30000)]
        train = workdir / "train.txt"
        train.write_text("\n".join(lines) + "\n")
    preprocess_main(["--trainpref", str(train), "--destdir", str(data), "--tokenizer", "wordpiece",
                     "--vocab-size", "8000", "--workers", "2"])
    return data


def train_flags(data: Path, arch: str, batch: int, updates: int, save_dir: Path) -> list[str]:
    return ["--task", "bert", "--data", str(data), "--arch", arch, "--max-sentences", str(batch),
            "--lr", "1e-4", "--warmup-updates", "10", "--total-num-update", "10000", "--clip-norm", "1.0",
            "--max-update", str(updates), "--save-dir", str(save_dir), "--no-save", "--disable-validation"]


def fixed_batches(task, count: int, batch: int) -> list[dict]:
    dataset = task.dataset("train")
    return [task.collater([dataset[(i * batch + j) % len(dataset)] for j in range(batch)]) for i in range(count)]


def plain_step(args, task, wrap: Callable[[torch.nn.Module], torch.nn.Module] = lambda model: model) -> Step:
    """The plain update: ``wrap`` may put the model into DDP and/or ``torch.compile``."""
    torch.manual_seed(args.seed)
    module = task.build_model(args).train()
    optimizer = torch.optim.AdamW(module.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    model = wrap(module)
    warmup, total = args.warmup_updates, args.total_num_update
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min((step + 1) / warmup, max(0.0, 1 - (step - warmup) / (total - warmup))))

    def step(sample: dict) -> None:
        optimizer.zero_grad(set_to_none=True)
        target = sample["target"]
        masked = target != -100
        logits = model(**sample["net_input"], masked_tokens=masked)["mlm_logits"]
        F.cross_entropy(logits.float(), target[masked]).backward()  # mean over masked tokens
        torch.nn.utils.clip_grad_norm_(module.parameters(), args.clip_norm)
        optimizer.step()
        schedule.step()

    return step


def plain_e2e_worker(flags: list[str], interval: int, num_workers: int, compile_model: bool) -> None:
    """A plain loop as a user writes it: DataLoader (shuffled, ``num_workers``) over the task's dataset and
    collater, the plain update (DDP under torchrun), a JSON progress line every ``interval`` updates."""
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    args = parse_train_args(flags)
    task = TASK_REGISTRY.get("bert").setup_task(args)
    dataset = task.dataset("train")
    distributed = "WORLD_SIZE" in os.environ
    rank = 0
    sampler = None
    if distributed:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)

    def wrap(model: torch.nn.Module) -> torch.nn.Module:
        model = DistributedDataParallel(model) if distributed else model
        return torch.compile(model) if compile_model else model

    step = plain_step(args, task, wrap)
    loader = DataLoader(dataset, batch_size=int(args.max_sentences), shuffle=sampler is None, sampler=sampler,
                        collate_fn=task.collater, num_workers=num_workers, drop_last=True)
    updates, started = 0, time.perf_counter()
    while updates < args.max_update:
        for sample in loader:
            step(sample)
            updates += 1
            if updates % interval == 0 and rank == 0:
                now = time.perf_counter()
                print(progress_line(updates, now - started, interval), flush=True)
                started = now
            if updates == args.max_update:
                break
    if distributed:
        dist.destroy_process_group()


def trainer_step(args, task, dummy: dict) -> Step:
    torch.manual_seed(args.seed)
    model, criterion = task.build_model(args), task.build_criterion(args)
    context = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    trainer = build_trainer(args, model, criterion, context, dummy)
    return lambda sample: trainer.train_step([sample])


def median_tokens_per_s(steps: dict[str, Step], batches: list[dict]) -> dict[str, float]:
    """Run every step function on every batch, alternating; median tokens/s after warm-up."""
    rates: dict[str, list[float]] = {name: [] for name in steps}
    for index, sample in enumerate(batches):
        for name, step in steps.items():
            start = time.perf_counter()
            step(sample)
            if index >= WARMUP_UPDATES:
                rates[name].append(sample["ntokens"] / (time.perf_counter() - start))
    return {name: statistics.median(values) for name, values in rates.items()}


def child(variant: str, flags: list[str], count: int, batch: int) -> dict:
    args = parse_train_args(flags)
    task = TASK_REGISTRY.get("bert").setup_task(args)
    if variant == "hetfair-train":
        log = io.StringIO()
        with contextlib.redirect_stderr(log):
            train_main(flags + ["--log-format", "json", "--log-interval", "1"])
        # each update's own tokens/s (data loading included), median after the warm-up, as for plain
        lines = [json.loads(line) for line in log.getvalue().splitlines() if '"phase": "train_inner"' in line]
        result = {"hetfair-train": statistics.median(r["wps"] for r in lines if r["num_updates"] > WARMUP_UPDATES)}
    else:
        batches = fixed_batches(task, count, batch)
        makers = {"plain": lambda: plain_step(args, task), "trainer": lambda: trainer_step(args, task, batches[0])}
        names = list(makers) if variant == "interleaved" else [variant]
        result = median_tokens_per_s({name: makers[name]() for name in names}, batches)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="bert_mini")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--updates", type=int, default=30)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--plain-e2e", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--interval", type=int, default=5, help=argparse.SUPPRESS)
    parser.add_argument("--num-workers", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="hetfair-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if options.plain_e2e:
        flags = train_flags(workdir / "data", options.arch, options.batch, options.updates, workdir / "ckpt")
        plain_e2e_worker(flags, options.interval, options.num_workers, options.compile)
        return
    count = options.updates + WARMUP_UPDATES
    if options.variant:
        flags = train_flags(workdir / "data", options.arch, options.batch, count, workdir / "ckpt")
        print(json.dumps(child(options.variant, flags, count, options.batch)))
        return

    prepare_data(workdir)
    results = {}
    for variant in ("interleaved", "plain", "trainer", "hetfair-train"):
        out = subprocess.run([sys.executable, __file__, "--variant", variant, "--arch", options.arch,
                              "--batch", str(options.batch), "--updates", str(options.updates),
                              "--threads", str(options.threads), "--workdir", str(workdir)],
                             check=True, capture_output=True, text=True).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
    same_load = results["interleaved"]
    print(f"{options.arch}, batch {options.batch} x <=128 tokens, {options.updates} timed updates, "
          f"{options.threads} threads; median tokens/s")
    print(f"{'variant':<14} {'interleaved':>12} {'vs plain':>9} {'alone':>8} {'peak RSS MiB':>13}")
    for variant in ("plain", "trainer"):
        print(f"{variant:<14} {same_load[variant]:>12.0f} {same_load[variant] / same_load['plain']:>9.3f} "
              f"{results[variant][variant]:>8.0f} {results[variant]['peak_rss_mib']:>13.0f}")
    full = results["hetfair-train"]
    print(f"{'hetfair-train':<14} {'':>12} {'':>9} {full['hetfair-train']:>8.0f} {full['peak_rss_mib']:>13.0f}"
          "  (its own wps; data loading included, own batch order)")


if __name__ == "__main__":
    main()

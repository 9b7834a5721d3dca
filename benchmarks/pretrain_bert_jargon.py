"""Pretrain ``bert_tiny`` on the Jargon File on CPU and show the validation MLM loss dropping.

The whole user flow: raw text -> ``hetfair-preprocess`` (a WordPiece vocabulary
trained on the training text) -> ``hetfair-train --task bert`` -> validation
loss over time. Usage::

    python benchmarks/pretrain_bert_jargon.py [--max-update 400] [--workdir DIR]

The Jargon File (Debian package ``jargon-text``) is wrapped text with blank lines
between paragraphs; each paragraph becomes one line ("sentence"), ten
consecutive paragraphs one document, and every 20th document goes to the
validation split.
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from hetfair.data.indexed_dataset import IndexedDataset
from hetfair.parallel.context import DistributedContext
from hetfair.options import parse_train_args
from hetfair.tasks import TASK_REGISTRY
from hetfair.run.validation import Validator
from hetfair_cli.preprocess import main as preprocess_main

JARGON = Path("/usr/share/doc/jargon-text/jargon.txt.gz")


def paragraphs(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        text = f.read()
    return [" ".join(block.split()) for block in text.split("\n\n") if block.strip()]


def write_splits(source: Path, out: Path, per_document: int = 10, valid_every: int = 20) -> tuple[Path, Path]:
    """Write train.txt / valid.txt in hetfair-preprocess's format."""
    parts = paragraphs(source)
    docs = ["\n".join(parts[i:i + per_document]) for i in range(0, len(parts), per_document)]
    train = [d for i, d in enumerate(docs) if i % valid_every]
    valid = [d for i, d in enumerate(docs) if not i % valid_every]
    (out / "train.txt").write_text("\n\n".join(train) + "\n", encoding="utf-8")
    (out / "valid.txt").write_text("\n\n".join(valid) + "\n", encoding="utf-8")
    return out / "train.txt", out / "valid.txt"


def initial_validation(train_args: list[str]) -> dict[str, float]:
    """Validation metrics of the untrained model (same options and seed as the run)."""
    args = parse_train_args(train_args)
    task = TASK_REGISTRY.get("bert").setup_task(args)
    torch.manual_seed(args.seed)
    model, criterion = task.build_model(args), task.build_criterion(args)
    context = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    return Validator(task, model, criterion, context, [args.max_sentences]).metrics("valid")


def unigram_bits(data_dir: Path) -> float:
    """Cross-entropy (bits) of the validation tokens under add-one unigram frequencies of the training
    tokens: a model below this uses context, not just word frequencies."""
    train, valid = IndexedDataset(str(data_dir / "train")), IndexedDataset(str(data_dir / "valid"))
    counts = np.bincount(np.asarray(train.tokens), minlength=int(np.max(valid.tokens)) + 1) + 1.0
    return float(-np.mean(np.log2(counts[np.asarray(valid.tokens)] / counts.sum())))


def run_training(train_args: list[str]) -> list[dict]:
    """Run hetfair-train as a user would; echo its log and return its JSON records."""
    command = [sys.executable, "-m", "hetfair_cli.train", *train_args, "--log-format", "json"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    records = []
    assert process.stderr is not None
    for line in process.stderr:
        print(line, end="", file=sys.stderr)
        if line.startswith("{"):
            records.append(json.loads(line))
    if process.wait() != 0:
        raise SystemExit(f"hetfair-train failed with exit code {process.returncode}")
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jargon", type=Path, default=JARGON)
    parser.add_argument("--workdir", type=Path, help="keep data and checkpoints here (default: a temp dir)")
    parser.add_argument("--max-update", type=int, default=400)
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--lr", type=float, default=1e-3)
    options = parser.parse_args()
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="hetfair-jargon-"))
    workdir.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    train_txt, valid_txt = write_splits(options.jargon, workdir)
    preprocess_main(["--trainpref", str(train_txt), "--validpref", str(valid_txt), "--destdir",
                     str(workdir / "data"), "--tokenizer", "wordpiece", "--vocab-size", str(options.vocab_size),
                     "--workers", "2"])
    preprocess_seconds = time.perf_counter() - start

    train_args = [
        "--task", "bert", "--data", str(workdir / "data"), "--arch", "bert_tiny", "--max-sentences", "32",
        "--lr", str(options.lr), "--warmup-updates", str(options.max_update // 10), "--weight-decay", "0.01",
        "--max-update", str(options.max_update), "--clip-norm", "1.0", "--log-interval", "50",
        "--validate-interval-updates", str(max(options.max_update // 4, 1)), "--no-epoch-checkpoints",
        "--save-dir", str(workdir / "checkpoints"), "--tensorboard-logdir", str(workdir / "tensorboard"),
    ]
    before = initial_validation(train_args)
    start = time.perf_counter()
    records = run_training(train_args)
    train_seconds = time.perf_counter() - start

    curve = [(0, before)] + [(r["num_updates"], r) for r in records if r.get("phase") == "valid"]
    print(f"\nvalidation masked-LM loss (bits per masked token), bert_tiny, vocab {options.vocab_size}:")
    print(f"{'update':>7} {'loss':>7} {'ppl':>9} {'acc %':>6}")
    for update, metrics in curve:
        print(f"{update:>7} {metrics['nll_loss']:>7.3f} {metrics['ppl']:>9.1f} {metrics['mlm_accuracy']:>6.1f}")
    print(f"unigram baseline: {unigram_bits(workdir / 'data'):.3f} bits")
    print(f"\npreprocess {preprocess_seconds:.1f} s, training {train_seconds:.1f} s "
          f"({options.max_update} updates), data in {workdir}")
    print(f"tensorboard --logdir {workdir / 'tensorboard'}")


if __name__ == "__main__":
    main()

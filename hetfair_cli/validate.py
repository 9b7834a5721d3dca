"""``hetfair-validate``: report a checkpoint's metrics on a split."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Sequence

from hetfair.errors import ConfigError
from hetfair.evaluate import evaluate_checkpoint
from hetfair.logging.progress import format_metrics
from hetfair.utils import DefaultsHelpFormatter, absolute_path
from hetfair_cli.errors import run_cli
from hetfair_cli.reader_watch import exit_when_reader_leaves

DESCRIPTION = """Report a checkpoint's metrics on one or more splits, computed as training validates.
One line per split on standard output, numbers formatted as in training's progress output
(or one JSON object per split with --json); notes such as where the data came from go to
standard error. The task, model and data are those stored in the checkpoint unless overridden.
Where to connect is never taken from the checkpoint: the task's own flags for that (e.g. the
mnist task's --mnist-mirror URL) are accepted here too."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetfair-validate", description=DESCRIPTION, allow_abbrev=False,
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--path", required=True, metavar="FILE", help="checkpoint file written by hetfair-train")
    parser.add_argument("--valid-subset", default="valid", metavar="SPLITS", help="comma-separated splits to evaluate")
    parser.add_argument("--data", metavar="DIR", type=absolute_path, help="data directory (default: the one used in training)")
    parser.add_argument("--user-dir", metavar="DIR", type=absolute_path,
                        help="plugin package the checkpoint's task comes from (never taken from the checkpoint)")
    parser.add_argument("--max-sentences", "--batch-size", type=int, dest="max_sentences_valid", metavar="N",
                        help="batch size for evaluation (default: the one used in training)")
    parser.add_argument("--num-workers", type=int, metavar="N",
                        help="DataLoader worker processes (default: as in training)")
    parser.add_argument("--cpu", action="store_true", default=None, help="evaluate on CPU")
    parser.add_argument("--json", action="store_true", help="print one JSON object per split")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    return parser


def _main(argv: list[str]) -> int:
    args, task_argv = build_parser().parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)  # e.g. the task's data notes
    if args.max_sentences_valid is not None and args.max_sentences_valid < 1:
        raise ConfigError(f"--max-sentences must be at least 1, got {args.max_sentences_valid}")
    if args.num_workers is not None and args.num_workers < 0:
        raise ConfigError(f"--num-workers must be at least 0, got {args.num_workers}")
    overrides = {"data": args.data, "max_sentences_valid": args.max_sentences_valid,
                 "num_workers": args.num_workers, "cpu": args.cpu}
    results = evaluate_checkpoint(Path(args.path), args.valid_subset.split(","), overrides, user_dir=args.user_dir,
                                  task_argv=task_argv)
    with exit_when_reader_leaves(sys.stdout):  # `hetfair-validate ... | head -1` evaluates no further split
        for subset, metrics in results:
            line = json.dumps({"subset": subset, **metrics}) if args.json else f"{subset} | {format_metrics(metrics)}"
            print(line, flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("hetfair-validate", _main, argv)


if __name__ == "__main__":
    raise SystemExit(main())

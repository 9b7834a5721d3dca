"""``hetfair-validate``: report a checkpoint's metrics on a split."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

from hetfair.errors import ConfigError
from hetfair.evaluate import evaluate_checkpoint
from hetfair.utils import absolute_path
from hetfair_cli.errors import run_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetfair-validate", description=__doc__, allow_abbrev=False)
    parser.add_argument("--path", required=True, help="checkpoint file written by hetfair-train")
    parser.add_argument("--valid-subset", default="valid", help="comma-separated splits to evaluate")
    parser.add_argument("--data", type=absolute_path, help="data directory (default: the one used in training)")
    parser.add_argument("--user-dir", type=absolute_path,
                        help="plugin package to import (a checkpoint's own --user-dir is never imported)")
    parser.add_argument("--max-sentences", "--batch-size", type=int, dest="max_sentences_valid",
                        help="batch size for evaluation")
    parser.add_argument("--num-workers", type=int, help="DataLoader worker processes")
    parser.add_argument("--cpu", action="store_true", default=None, help="evaluate on CPU")
    parser.add_argument("--json", action="store_true", help="print one JSON object per split")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    return parser


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.max_sentences_valid is not None and args.max_sentences_valid < 1:
        raise ConfigError(f"--max-sentences must be at least 1, got {args.max_sentences_valid}")
    if args.num_workers is not None and args.num_workers < 0:
        raise ConfigError(f"--num-workers must be at least 0, got {args.num_workers}")
    overrides = {"data": args.data, "user_dir": args.user_dir, "max_sentences_valid": args.max_sentences_valid,
                 "num_workers": args.num_workers, "cpu": args.cpu}
    for subset in args.valid_subset.split(","):
        metrics = evaluate_checkpoint(Path(args.path), subset, overrides)
        if args.json:
            print(json.dumps({"subset": subset, **metrics}))
        else:
            print(f"{subset} | " + " | ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("hetfair-validate", _main, argv)


if __name__ == "__main__":
    raise SystemExit(main())

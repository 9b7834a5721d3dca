"""``hetfair-preprocess --task toyfam``: ``train.pt`` and ``valid.pt``, points on a plane drawn from ``--seed``."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

SPLITS = {"train": 1, "valid": 2}
FEATURES = 4


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetfair-preprocess", allow_abbrev=False)
    parser.add_argument("--destdir", required=True, metavar="DIR", help="where train.pt and valid.pt go")
    parser.add_argument("--num-samples", type=int, default=64, metavar="N", help="training points")
    parser.add_argument("--seed", type=int, default=1)
    return parser


def preprocess(args: argparse.Namespace) -> None:
    destdir = Path(args.destdir)
    destdir.mkdir(parents=True, exist_ok=True)
    weight = torch.randn(FEATURES, 1, generator=torch.Generator().manual_seed(args.seed))
    for split, offset in SPLITS.items():
        generator = torch.Generator().manual_seed(args.seed * 100 + offset)
        x = torch.randn(args.num_samples, FEATURES, generator=generator)
        torch.save({"x": x, "y": x @ weight}, destdir / f"{split}.pt")

"""SGD with optional momentum."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from hetfair.optim import register_optimizer
from hetfair.optim.optimizer import HetfairOptimizer


@register_optimizer("sgd")
class SGD(HetfairOptimizer):
    torch_class = torch.optim.SGD

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--momentum", type=float, default=0.0, help="SGD momentum factor")
        parser.add_argument("--nesterov", action="store_true", help="use Nesterov momentum")

    @classmethod
    def torch_kwargs(cls, args: argparse.Namespace) -> dict[str, Any]:
        return {**super().torch_kwargs(args), "momentum": args.momentum, "nesterov": args.nesterov}

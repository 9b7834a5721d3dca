"""Adam (L2 weight decay) and AdamW (decoupled weight decay)."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from hetfair.errors import ConfigError
from hetfair.optim import register_optimizer
from hetfair.optim.optimizer import HetfairOptimizer


def _parse_betas(text: str) -> tuple[float, float]:
    try:
        values = tuple(float(v) for v in text.strip("()[] ").split(","))
    except ValueError:
        values = ()
    if len(values) != 2:
        raise ConfigError(f"--adam-betas must be two numbers like '0.9,0.999', got '{text}'")
    return values  # type: ignore[return-value]


class _AdamFamily(HetfairOptimizer):
    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--adam-betas", default="0.9,0.999", metavar="B1,B2", help="Adam beta coefficients")
        parser.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon")

    @classmethod
    def torch_kwargs(cls, args: argparse.Namespace) -> dict[str, Any]:
        return {**super().torch_kwargs(args), "betas": _parse_betas(args.adam_betas), "eps": args.adam_eps}


@register_optimizer("adam")
class Adam(_AdamFamily):
    torch_class = torch.optim.Adam


@register_optimizer("adamw")
class AdamW(_AdamFamily):
    torch_class = torch.optim.AdamW

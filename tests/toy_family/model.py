"""``toyfam_linear`` (``--toyfam-hidden 0``: one linear layer) and its architecture ``toyfam_wide``."""

from __future__ import annotations

import argparse

import torch
from torch import nn

from hetfair import register_model_architecture
from hetfair.models import HetfairModel


class ToyFamLinear(HetfairModel):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 1)) if hidden else nn.Linear(4, 1)

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--toyfam-hidden", type=int, default=0, metavar="N", help="hidden units (0: linear)")

    @classmethod
    def build_model(cls, args: argparse.Namespace, task: object) -> "ToyFamLinear":
        return cls(args.toyfam_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@register_model_architecture("toyfam_linear", "toyfam_wide")
def toyfam_wide() -> dict[str, int]:
    return {"toyfam_hidden": 32}

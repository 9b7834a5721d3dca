"""``example_mlp`` and its named architectures."""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn

import hetfair
from hetfair.models import HetfairModel
from hetfair.tasks import Task


@hetfair.register_model("example_mlp")
class ExampleMLP(HetfairModel):
    """``--num-hidden-layers`` ReLU layers of ``--hidden-dim`` units, then one output."""

    def __init__(self, input_dim: int, hidden_dim: int, num_hidden_layers: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = input_dim
        for _ in range(num_hidden_layers):
            layers += [nn.Linear(width, hidden_dim), nn.ReLU()]
            width = hidden_dim
        layers.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*layers)

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--hidden-dim", type=int, default=32, metavar="N", help="units per hidden layer")
        parser.add_argument("--num-hidden-layers", type=int, default=1, metavar="N",
                            help="hidden layers (0: a linear model)")

    @classmethod
    def build_model(cls, args: argparse.Namespace, task: Task) -> ExampleMLP:
        return cls(task.input_dim, args.hidden_dim, args.num_hidden_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@hetfair.register_model_architecture("example_mlp", "example_mlp_tiny")
def example_mlp_tiny() -> dict[str, Any]:
    return {"hidden_dim": 8, "num_hidden_layers": 1}


@hetfair.register_model_architecture("example_mlp", "example_linear")
def example_linear() -> dict[str, Any]:
    return {"num_hidden_layers": 0}

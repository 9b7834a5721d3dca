"""Models for 28x28 grey-scale images: a small CNN and an MLP, with named architectures."""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn

from hetfair import register_model, register_model_architecture
from hetfair.models import HetfairModel
from hetfair.tasks import Task

from .mnist_data import IMAGE_SIZE, NUM_CLASSES


@register_model("mnist_cnn")
class MnistCNN(HetfairModel):
    """``[conv3x3 - ReLU - maxpool2] x 2 - fc - ReLU - dropout - fc``: logits ``[B, 10]`` from ``[B, 1, 28, 28]``."""

    def __init__(self, conv1_channels: int, conv2_channels: int, fc_dim: int, dropout: float) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, conv1_channels, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(conv1_channels, conv2_channels, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        pooled = IMAGE_SIZE // 4
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(conv2_channels * pooled * pooled, fc_dim),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(fc_dim, NUM_CLASSES),
        )

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--conv1-channels", type=int, default=32, metavar="N", help="channels of the first conv")
        parser.add_argument("--conv2-channels", type=int, default=64, metavar="N", help="channels of the second conv")
        parser.add_argument("--fc-dim", type=int, default=128, metavar="N", help="width of the hidden linear layer")
        parser.add_argument("--dropout", type=float, default=0.0, metavar="P",
                            help="dropout before the output layer (default 0: updates stay deterministic)")

    @classmethod
    def build_model(cls, args: argparse.Namespace, task: Task) -> "MnistCNN":
        return cls(args.conv1_channels, args.conv2_channels, args.fc_dim, args.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


@register_model_architecture("mnist_cnn", "mnist_cnn_small")
def mnist_cnn_small() -> dict[str, Any]:
    """Half the widths of ``mnist_cnn``: about 3x faster per epoch on CPU."""
    return {"conv1_channels": 16, "conv2_channels": 32, "fc_dim": 64}


@register_model("mnist_mlp")
class MnistMLP(HetfairModel):
    """``flatten - fc - ReLU - dropout - fc``: logits ``[B, 10]`` from ``[B, 1, 28, 28]``."""

    def __init__(self, hidden_dim: int, dropout: float) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Flatten(),
            nn.Linear(IMAGE_SIZE * IMAGE_SIZE, hidden_dim),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden_dim, NUM_CLASSES),
        )

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--hidden-dim", type=int, default=256, metavar="N", help="width of the hidden layer")
        parser.add_argument("--dropout", type=float, default=0.0, metavar="P",
                            help="dropout before the output layer (default 0: updates stay deterministic)")

    @classmethod
    def build_model(cls, args: argparse.Namespace, task: Task) -> "MnistMLP":
        return cls(args.hidden_dim, args.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

"""A --user-dir plugin for bench_zero.py: random classification data and a wide MLP."""

from __future__ import annotations

import argparse

import torch
from torch import nn

from hetfair import register_model, register_task
from hetfair.models import HetfairModel
from hetfair.tasks import Task

FEATURES = 256
CLASSES = 10


class RandomBlobs(torch.utils.data.Dataset):
    """Fixed random inputs and labels (the benchmark measures memory and time, not learning)."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(size, FEATURES, generator=generator)
        self.labels = torch.randint(0, CLASSES, (size,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.labels[index]


@register_task("bench_random")
class RandomTask(Task):
    option_defaults = {"arch": "bench_mlp", "criterion": "cross_entropy"}

    def load_dataset(self, split: str) -> RandomBlobs:
        return RandomBlobs(1024)


@register_model("bench_mlp")
class WideMLP(HetfairModel):
    """``layers`` hidden layers of ``hidden`` units: about ``layers * hidden**2`` parameters."""

    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        blocks: list[nn.Module] = [nn.Linear(FEATURES, hidden), nn.ReLU()]
        for _ in range(layers):
            blocks += [nn.Linear(hidden, hidden), nn.ReLU()]
        self.net = nn.Sequential(*blocks, nn.Linear(hidden, CLASSES))

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--bench-hidden", type=int, default=768)
        parser.add_argument("--bench-layers", type=int, default=12)

    @classmethod
    def build_model(cls, args: argparse.Namespace, task: Task) -> "WideMLP":
        return cls(args.bench_hidden, args.bench_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

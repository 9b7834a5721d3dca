"""A tiny deterministic task + model for trainer tests (a --user-dir package)."""

from __future__ import annotations

import argparse

import torch
from torch import nn

from hetfair import register_model, register_model_architecture, register_task
from hetfair.models import HetfairModel
from hetfair.tasks import Task


class Blobs(torch.utils.data.Dataset):
    """Gaussian blobs around three class centres; fixed by ``seed``."""

    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 3, (size,), generator=generator)
        self.inputs = torch.randn(size, 8, generator=generator) + self.labels[:, None].float()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.labels[index]


@register_task("toy")
class ToyTask(Task):
    option_defaults = {"arch": "toy_mlp", "criterion": "cross_entropy", "max_sentences": 16}

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--toy-train-size", type=int, default=200)

    def load_dataset(self, split: str) -> Blobs:
        if split == "train":
            return Blobs(self.args.toy_train_size, seed=0)
        return Blobs(60, seed=1)


@register_model("toy_mlp")
class ToyMLP(HetfairModel):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 3))

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--toy-hidden", type=int, default=16)

    @classmethod
    def build_model(cls, args: argparse.Namespace, task: Task) -> "ToyMLP":
        return cls(args.toy_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@register_model_architecture("toy_mlp", "toy_mlp_wide")
def toy_mlp_wide() -> dict:
    return {"toy_hidden": 64}

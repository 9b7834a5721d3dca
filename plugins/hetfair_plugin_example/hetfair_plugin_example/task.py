"""``example_regression``: noisy linear regression generated from ``--seed``."""

from __future__ import annotations

import argparse
from typing import Any, ClassVar

import torch
from torch.utils.data import Dataset, TensorDataset

import hetfair
from hetfair.errors import DataError
from hetfair.tasks import Task

# Different splits get different points of the same underlying function.
_SPLIT_OFFSETS = {"train": 1, "valid": 2, "test": 3}


@hetfair.register_task("example_regression")
class ExampleRegressionTask(Task):
    """Learn ``y = x . w + b + noise``; ``w`` and ``b`` are drawn from ``--seed``."""

    option_defaults: ClassVar[dict[str, Any]] = {
        "arch": "example_mlp_tiny",
        "criterion": "mse",
        "max_sentences": 32,
        "max_epoch": 5,
        "lr": 0.01,
    }

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--num-samples", type=int, default=512, metavar="N",
                            help="training points (valid/test get a quarter each)")
        parser.add_argument("--input-dim", type=int, default=8, metavar="D", help="features per point")
        parser.add_argument("--noise", type=float, default=0.1, help="standard deviation of the label noise")

    @property
    def input_dim(self) -> int:
        return int(self.args.input_dim)

    def load_dataset(self, split: str) -> Dataset:
        if split not in _SPLIT_OFFSETS:
            raise DataError(
                f"task example_regression has no split '{split}'; splits: {', '.join(_SPLIT_OFFSETS)}"
            )
        weight, bias = self._true_function()
        size = self.args.num_samples if split == "train" else max(self.args.num_samples // 4, 1)
        generator = torch.Generator().manual_seed(self.args.seed * 1000 + _SPLIT_OFFSETS[split])
        inputs = torch.randn(size, self.input_dim, generator=generator)
        noise = self.args.noise * torch.randn(size, 1, generator=generator)
        return TensorDataset(inputs, inputs @ weight + bias + noise)

    def _true_function(self) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.args.seed)
        return torch.randn(self.input_dim, 1, generator=generator), torch.randn(1, generator=generator)

    def collater(self, samples: list[Any]) -> dict[str, Any]:
        inputs = torch.stack([x for x, _ in samples])
        targets = torch.stack([y for _, y in samples])
        return {
            "net_input": {"x": inputs},
            "target": targets,
            "nsentences": len(samples),
        }

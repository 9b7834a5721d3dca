"""Synthetic data and model shared by two ``--user-dir`` plugins; not part of hetfair.

Used by the tests' toy task (``tests/toy_plugin``) and the simulated cluster
(``benchmarks/simcluster``). Each of them appends this directory to ``sys.path``
and imports ``toydata``, so it is found wherever the plugin is imported: in
pytest, under ``python benchmarks/NAME.py`` and in spawned worker processes.
"""

from __future__ import annotations

import torch
from torch import nn

FEATURES = 8
CLASSES = 3


class Blobs(torch.utils.data.Dataset):
    """Gaussian blobs in 8 dimensions around three class centres; fixed by ``seed``."""

    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, CLASSES, (size,), generator=generator)
        self.inputs = torch.randn(size, FEATURES, generator=generator) + self.labels[:, None].float()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.labels[index]


def blobs_split(split: str, train_size: int) -> Blobs:
    """``train``: ``train_size`` samples of seed 0; any other split: 60 samples of seed 1."""
    return Blobs(train_size, seed=0) if split == "train" else Blobs(60, seed=1)


def blobs_mlp(hidden: int) -> nn.Sequential:
    """``Linear(8, hidden) - Tanh - Linear(hidden, 3)``."""
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, CLASSES))

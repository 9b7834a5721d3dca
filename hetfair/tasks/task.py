"""The :class:`Task` base class: what a task plugin implements."""

from __future__ import annotations

import argparse
from typing import Any, ClassVar

import torch
from torch.utils.data import Dataset

from hetfair.criteria import CRITERION_REGISTRY
from hetfair.models import MODEL_REGISTRY


class Task:
    """Builds datasets, the model and the criterion for one kind of training.

    A task plugin subclasses this, registers it with ``@register_task(name)``,
    declares its flags in :meth:`add_args` and implements :meth:`load_dataset`.

    ``option_defaults`` sets defaults for *core* options when this task is
    chosen, e.g. ``{"criterion": "cross_entropy", "arch": "mnist_cnn",
    "max_sentences": 64}``; the command line still overrides them.

    ``network_options`` names this task's options (their ``args`` attributes) that say where
    to connect, e.g. a download mirror: a checkpoint's values of them are never used outside
    training, only those of the command line that loads it (``hetfair-validate --mnist-mirror``).
    """

    option_defaults: ClassVar[dict[str, Any]] = {}
    network_options: ClassVar[tuple[str, ...]] = ()

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self._datasets: dict[str, Dataset] = {}

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        """Add this task's flags to ``parser``."""

    @classmethod
    def setup_task(cls, args: argparse.Namespace) -> "Task":
        """Create the task (load vocabularies etc.) from parsed arguments."""
        return cls(args)

    def load_dataset(self, split: str) -> Dataset:
        """Return the dataset of ``split`` (e.g. ``train``, ``valid``, ``test``)."""
        raise NotImplementedError

    def dataset(self, split: str) -> Dataset:
        """The dataset of ``split``, loaded once."""
        if split not in self._datasets:
            self._datasets[split] = self.load_dataset(split)
        return self._datasets[split]

    def collater(self, samples: list[Any]) -> dict[str, Any]:
        """Merge dataset items into a batch dict.

        The batch must contain an ``nsentences`` count (samples) and, where samples are token
        sequences, an ``ntokens`` count (``wps`` reads it; without it the progress shows ``sps``,
        samples per second). The default stacks ``(input, target)`` pairs (images, vectors: no
        tokens) into ``{"net_input": {"x": ...}, "target": ...}``.
        """
        inputs = torch.stack([item[0] for item in samples])
        targets = torch.as_tensor([int(item[1]) for item in samples])
        return {
            "net_input": {"x": inputs},
            "target": targets,
            "nsentences": len(samples),
        }

    def max_positions(self) -> int | None:
        """Longest item in tokens, used to turn ``--max-tokens`` into a batch size."""
        return None

    def begin_epoch(self, epoch: int) -> None:
        """Called before each epoch (1-based), e.g. to redraw dynamic masks."""

    def build_model(self, args: argparse.Namespace) -> torch.nn.Module:
        return MODEL_REGISTRY.get(args.model).build_model(args, self)

    def build_criterion(self, args: argparse.Namespace) -> torch.nn.Module:
        return CRITERION_REGISTRY.get(args.criterion).build_criterion(args, self)

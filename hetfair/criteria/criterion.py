"""The :class:`HetfairCriterion` base class and its contract."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from hetfair.tasks import Task

LoggingOutput = dict[str, float]


class HetfairCriterion(nn.Module):
    """Computes the loss of one batch.

    Contract: :meth:`forward` returns ``(loss, sample_size, logging_output)`` where
    ``loss`` is a **sum** over the batch's units (samples, tokens, masked tokens),
    ``sample_size`` is the number of those units, and ``logging_output`` is a flat
    dict of numbers that can be summed across ranks and micro-batches (the
    trainer adds the summed ``sample_size`` to it under that key).
    :meth:`reduce_metrics` turns such summed logs into reported metrics.
    """

    def __init__(self, task: "Task") -> None:
        super().__init__()
        self.task = task

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        """Add this criterion's flags to ``parser``."""

    @classmethod
    def build_criterion(cls, args: argparse.Namespace, task: "Task") -> "HetfairCriterion":
        return cls(task)

    def forward(self, model: nn.Module, sample: dict[str, Any]) -> tuple[torch.Tensor, int, LoggingOutput]:
        raise NotImplementedError

    def model_inputs(self, sample: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments :meth:`forward` calls the model with: ``sample["net_input"]`` unless the
        criterion adds its own. A pipeline passes them to every stage (:mod:`hetfair.parallel.pipeline`)."""
        return sample["net_input"]

    @staticmethod
    def reduce_metrics(logs: LoggingOutput) -> dict[str, float]:
        """Metrics to report from logging outputs summed over ranks and batches."""
        sample_size = max(logs.get("sample_size", 0.0), 1.0)
        return {"loss": logs.get("loss", 0.0) / sample_size}

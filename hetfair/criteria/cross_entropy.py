"""Classification cross-entropy: summed over samples, logs accuracy."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hetfair.criteria import register_criterion
from hetfair.criteria.criterion import HetfairCriterion, LoggingOutput


@register_criterion("cross_entropy")
class CrossEntropyCriterion(HetfairCriterion):
    """``loss = sum_i -log p(target_i)``; ``sample_size`` = number of samples.

    A subclass logs more counts of the predictions by extending :meth:`counts` and
    :meth:`reduce_metrics`.
    """

    def forward(self, model: nn.Module, sample: dict[str, Any]) -> tuple[torch.Tensor, int, LoggingOutput]:
        logits = model(**sample["net_input"]).float()  # softmax and loss in fp32, also under autocast
        target = sample["target"]
        loss = F.cross_entropy(logits, target, reduction="sum")
        stats = {"loss": loss.detach(), **self.counts(logits, logits.argmax(dim=-1), target)}
        # One device-to-host copy for all statistics.
        logging_output = dict(zip(stats, torch.stack([v.double() for v in stats.values()]).tolist()))
        logging_output["nsentences"] = float(sample["nsentences"])
        if "ntokens" in sample:  # token tasks; an image has none
            logging_output["ntokens"] = float(sample["ntokens"])
        return loss, int(target.numel()), logging_output

    def counts(self, logits: torch.Tensor, predicted: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        """Sums over the batch's samples to log (0-d tensors): here the correct predictions."""
        return {"correct": (predicted == target).sum()}

    @staticmethod
    def reduce_metrics(logs: LoggingOutput) -> dict[str, float]:
        sample_size = max(logs.get("sample_size", 0.0), 1.0)
        return {
            "loss": logs.get("loss", 0.0) / sample_size,
            "accuracy": 100.0 * logs.get("correct", 0.0) / sample_size,
        }

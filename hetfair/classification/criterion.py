"""Sentence-classification cross-entropy, summed over sentences; accuracy and (two classes) F1.

Everything logged is a count or a sum over sentences, so it adds up over micro-batches and
ranks: F1 is computed from the summed true positives, false positives and false negatives of
class 1 (the positive class), never averaged from per-batch F1s. ``loss`` is in nats per sentence,
``accuracy`` and ``f1`` in percent; both work as ``--best-checkpoint-metric`` (with
``--maximize-best-checkpoint-metric``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hetfair.criteria import register_criterion
from hetfair.criteria.criterion import HetfairCriterion, LoggingOutput

POSITIVE = 1
"""The class index F1 counts as positive (of two classes)."""


@register_criterion("sentence_classification")
class SentenceClassificationCriterion(HetfairCriterion):
    """``loss = sum_i -log p(target_i)``; ``sample_size`` = number of sentences."""

    def forward(self, model: nn.Module, sample: dict[str, Any]) -> tuple[torch.Tensor, int, LoggingOutput]:
        logits = model(**sample["net_input"]).float()  # softmax and loss in fp32, also under autocast
        target = sample["target"]
        loss = F.cross_entropy(logits, target, reduction="sum")
        predicted = logits.argmax(dim=-1)
        stats = {"loss": loss.detach(), "correct": (predicted == target).sum()}
        if logits.shape[-1] == 2:
            stats["true_positives"] = ((predicted == POSITIVE) & (target == POSITIVE)).sum()
            stats["false_positives"] = ((predicted == POSITIVE) & (target != POSITIVE)).sum()
            stats["false_negatives"] = ((predicted != POSITIVE) & (target == POSITIVE)).sum()
        # One device-to-host copy for all statistics.
        logging_output = dict(zip(stats, torch.stack([v.double() for v in stats.values()]).tolist()))
        logging_output["nsentences"] = float(sample["nsentences"])
        logging_output["ntokens"] = float(sample["ntokens"])
        return loss, int(target.numel()), logging_output

    @staticmethod
    def reduce_metrics(logs: LoggingOutput) -> dict[str, float]:
        sentences = max(logs.get("sample_size", 0.0), 1.0)
        metrics = {"loss": logs.get("loss", 0.0) / sentences, "accuracy": 100.0 * logs.get("correct", 0.0) / sentences}
        if "true_positives" in logs:
            tp, fp, fn = logs["true_positives"], logs.get("false_positives", 0.0), logs.get("false_negatives", 0.0)
            metrics["f1"] = 100.0 * 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0
        return metrics

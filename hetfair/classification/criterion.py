"""Sentence-classification cross-entropy, summed over sentences; accuracy and (two classes) F1.

Everything logged is a count or a sum over sentences, so it adds up over micro-batches and
ranks: F1 is computed from the summed true positives, false positives and false negatives of
class 1 (the positive class), never averaged from per-batch F1s. ``loss`` is in nats per sentence,
``accuracy`` and ``f1`` in percent; both work as ``--best-checkpoint-metric`` (with
``--maximize-best-checkpoint-metric``).
"""

from __future__ import annotations

import torch

from hetfair.criteria import register_criterion
from hetfair.criteria.criterion import LoggingOutput
from hetfair.criteria.cross_entropy import CrossEntropyCriterion

POSITIVE = 1
"""The class index F1 counts as positive (of two classes)."""


@register_criterion("sentence_classification")
class SentenceClassificationCriterion(CrossEntropyCriterion):
    """``loss = sum_i -log p(target_i)``; ``sample_size`` = number of sentences; with two classes also the
    counts F1 is made of."""

    def counts(self, logits: torch.Tensor, predicted: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        counts = super().counts(logits, predicted, target)
        if logits.shape[-1] == 2:
            counts["true_positives"] = ((predicted == POSITIVE) & (target == POSITIVE)).sum()
            counts["false_positives"] = ((predicted == POSITIVE) & (target != POSITIVE)).sum()
            counts["false_negatives"] = ((predicted != POSITIVE) & (target == POSITIVE)).sum()
        return counts

    @staticmethod
    def reduce_metrics(logs: LoggingOutput) -> dict[str, float]:
        metrics = CrossEntropyCriterion.reduce_metrics(logs)
        if "true_positives" in logs:
            tp, fp, fn = logs["true_positives"], logs.get("false_positives", 0.0), logs.get("false_negatives", 0.0)
            metrics["f1"] = 100.0 * 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0
        return metrics

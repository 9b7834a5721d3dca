"""Masked-LM cross-entropy summed over masked tokens, plus optional next-sentence prediction.

Reported losses are in base 2 (bits per masked token), as in fairseq and
HetSeq; ``ppl = 2 ** nll_loss``.

With NSP the loss of sentence ``i`` is weighted by its number of masked tokens
``m_i``::

    loss = sum_i (mlm_i + w * m_i * nsp_i)      sample_size = sum_i m_i

where ``mlm_i`` is the summed MLM loss of sentence ``i``. After the trainer's
division by the total sample size this is the masked-token-weighted average of
``mlm_i / m_i + w * nsp_i``: BERT's ``mean MLM + w * mean NSP`` whenever
sentences carry equal numbers of masks (packed blocks nearly always do), while
remaining a plain sum over sentences, so any split of a global batch over ranks
and micro-batches gives the same update. Dividing the NSP sum by the sentence
count per micro-batch (fairseq's legacy criterion) would lose that property.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hetfair.criteria import register_criterion
from hetfair.bert.masking import IGNORE_INDEX
from hetfair.criteria.criterion import HetfairCriterion, LoggingOutput


@register_criterion("masked_lm")
class MaskedLmCriterion(HetfairCriterion):
    """Cross-entropy of the masked tokens; ``sample_size`` = number of masked tokens."""

    def __init__(self, task: Any, nsp_loss_weight: float = 1.0) -> None:
        super().__init__(task)
        self.nsp_loss_weight = nsp_loss_weight

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--nsp-loss-weight", type=float, default=1.0, metavar="W",
                            help="weight of next-sentence prediction relative to the masked LM (with --nsp)")

    @classmethod
    def build_criterion(cls, args: argparse.Namespace, task: Any) -> "MaskedLmCriterion":
        return cls(task, args.nsp_loss_weight)

    def forward(self, model: nn.Module, sample: dict[str, Any]) -> tuple[torch.Tensor, int, LoggingOutput]:
        target = sample["target"]
        masked = target != IGNORE_INDEX
        output = model(**self.model_inputs(sample))
        logits = output["mlm_logits"].float()
        targets = target[masked]
        loss = F.cross_entropy(logits, targets, reduction="sum")
        stats = {"nll_loss": loss.detach(), "mlm_correct": (logits.argmax(dim=-1) == targets).sum()}
        if "nsp_logits" in output:
            nsp_logits = output["nsp_logits"].float()
            nsp_labels = sample["nsentence_labels"]
            nsp_per_sentence = F.cross_entropy(nsp_logits, nsp_labels, reduction="none")
            masks_per_sentence = masked.sum(dim=1).to(nsp_per_sentence.dtype)
            loss = loss + self.nsp_loss_weight * (masks_per_sentence * nsp_per_sentence).sum()
            stats["nsp_loss"] = nsp_per_sentence.detach().sum()
            stats["nsp_correct"] = (nsp_logits.argmax(dim=-1) == nsp_labels).sum()
            stats["nsp_count"] = torch.tensor(nsp_labels.numel(), device=loss.device)
        stats["loss"] = loss.detach()
        # One device-to-host copy for all statistics.
        logging_output = dict(zip(stats, torch.stack([v.double() for v in stats.values()]).tolist()))
        logging_output["nsentences"] = float(sample["nsentences"])
        logging_output["ntokens"] = float(sample["ntokens"])
        sample_size = int(targets.numel())
        return loss, sample_size, logging_output

    def model_inputs(self, sample: dict[str, Any]) -> dict[str, Any]:
        """The sample's inputs, and its masked positions: the LM head scores only those."""
        return {**sample["net_input"], "masked_tokens": sample["target"] != IGNORE_INDEX}

    @staticmethod
    def reduce_metrics(logs: LoggingOutput) -> dict[str, float]:
        """``loss``/``nll_loss`` in bits per masked token, ``ppl``, accuracies in percent."""
        masked = max(logs.get("sample_size", 0.0), 1.0)
        nll = logs.get("nll_loss", 0.0) / masked / math.log(2)
        metrics = {
            "loss": logs.get("loss", 0.0) / masked / math.log(2),
            "nll_loss": nll,
            "ppl": 2.0 ** min(nll, 1000.0),
            "mlm_accuracy": 100.0 * logs.get("mlm_correct", 0.0) / masked,
        }
        if logs.get("nsp_count"):
            metrics["nsp_loss"] = logs["nsp_loss"] / logs["nsp_count"] / math.log(2)
            metrics["nsp_accuracy"] = 100.0 * logs["nsp_correct"] / logs["nsp_count"]
        return metrics

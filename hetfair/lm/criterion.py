"""Next-token cross-entropy summed over the target tokens of a batch.

Reported in base 2 as fairseq does (``loss`` in bits per token, ``ppl = 2 ** loss``). The sum over
tokens and ``sample_size`` = their number make any split of a global batch over ranks and
micro-batches give the same update: the trainer divides the summed loss by the summed count.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hetfair.criteria import register_criterion
from hetfair.criteria.criterion import HetfairCriterion, LoggingOutput


@register_criterion("lm_cross_entropy")
class LmCrossEntropyCriterion(HetfairCriterion):
    """``loss = sum_t -log p(target_t | tokens before t)`` over non-padding targets; ``sample_size`` = their number."""

    def forward(self, model: nn.Module, sample: dict[str, Any]) -> tuple[torch.Tensor, int, LoggingOutput]:
        logits = model(**sample["net_input"])
        target = sample["target"]
        # softmax and loss in fp32, also under autocast
        loss = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=self.task.pad_index,
                               reduction="sum")
        logging_output = {
            "loss": float(loss.detach()),
            "nsentences": float(sample["nsentences"]),
            "ntokens": float(sample["ntokens"]),
        }
        return loss, int(sample["ntokens"]), logging_output

    @staticmethod
    def reduce_metrics(logs: LoggingOutput) -> dict[str, float]:
        """``loss`` in bits per predicted token and the perplexity ``ppl = 2 ** loss``."""
        loss = logs.get("loss", 0.0) / max(logs.get("sample_size", 0.0), 1.0) / math.log(2)
        return {"loss": loss, "ppl": 2.0 ** min(loss, 1000.0)}

"""``mse``: squared error summed over samples (hetfair's summed-loss contract)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import hetfair
from hetfair.criteria import HetfairCriterion, LoggingOutput


@hetfair.register_criterion("mse")
class MSECriterion(HetfairCriterion):
    """``loss = sum_i ||model(x_i) - y_i||^2``; ``sample_size`` = number of samples.

    The base class reports ``loss / sample_size``, i.e. the mean squared error.
    """

    def forward(self, model: nn.Module, sample: dict[str, Any]) -> tuple[torch.Tensor, int, LoggingOutput]:
        prediction = model(**sample["net_input"])
        loss = (prediction - sample["target"]).pow(2).sum()
        sample_size = int(sample["target"].size(0))
        logging_output = {
            "loss": float(loss.detach()),
            "sample_size": float(sample_size),
            "nsentences": float(sample["nsentences"]),
        }
        return loss, sample_size, logging_output


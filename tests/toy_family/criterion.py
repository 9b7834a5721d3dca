"""``toyfam_mse``: the squared error summed over samples; ``sample_size`` counts them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hetfair.criteria import HetfairCriterion, LoggingOutput


class ToyFamMSE(HetfairCriterion):
    def forward(self, model: nn.Module, sample: dict[str, Any]) -> tuple[torch.Tensor, int, LoggingOutput]:
        loss = (model(**sample["net_input"]) - sample["target"]).pow(2).sum()
        size = int(sample["target"].size(0))
        return loss, size, {"loss": float(loss.detach()), "sample_size": float(size)}

"""``toyfam``: fit the points ``hetfair-preprocess --task toyfam`` wrote into ``--data``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.utils.data import Dataset, TensorDataset

from hetfair.errors import DataError
from hetfair.tasks import Task


class ToyFamTask(Task):
    option_defaults: ClassVar[dict[str, Any]] = {"arch": "toyfam_linear", "criterion": "toyfam_mse",
                                                 "max_sentences": 8, "lr": 0.05}

    def load_dataset(self, split: str) -> Dataset:
        path = Path(self.args.data or ".") / f"{split}.pt"
        if not path.is_file():
            raise DataError(f"{path} does not exist; write it with hetfair-preprocess --task toyfam --destdir DIR")
        data = torch.load(path, weights_only=True)
        return TensorDataset(data["x"], data["y"])

"""Language-model samples: the split's token stream cut into blocks of ``tokens_per_sample``.

As fairseq's ``language_modeling`` task with ``--sample-break-mode none``: documents (each ended
by the end-of-text token) follow each other in one stream, block ``i`` is the ``tokens_per_sample``
tokens from ``i * tokens_per_sample`` and its target the same tokens shifted by one (the last
token of a block predicts the first of the next). Only the last block can be shorter; the
collater pads it, and padded targets are not predicted. A block depends on its index alone, so
every rank, batch split and DataLoader worker sees the same stream.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from hetfair.data.indexed_dataset import IndexedDataset
from hetfair.errors import ConfigError, DataError


class TokenBlockDataset(Dataset):
    """Blocks of ``tokens_per_sample`` consecutive tokens of ``data`` and their next tokens."""

    def __init__(self, data: IndexedDataset, tokens_per_sample: int) -> None:
        if tokens_per_sample < 1:
            raise ConfigError(f"--tokens-per-sample must be at least 1, got {tokens_per_sample}")
        if data.num_tokens < 2:
            raise DataError(f"{data.prefix} holds {data.num_tokens} token(s): a language model needs at least 2")
        self.tokens = data.tokens
        self.tokens_per_sample = tokens_per_sample
        self._length = math.ceil((data.num_tokens - 1) / tokens_per_sample)  # every token but the last is an input

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict[str, Any]:
        start = index * self.tokens_per_sample
        window = np.asarray(self.tokens[start:start + self.tokens_per_sample + 1], dtype=np.int64)
        return {"id": index, "source": torch.from_numpy(window[:-1]), "target": torch.from_numpy(window[1:])}


def collate_blocks(samples: list[dict[str, Any]], pad_index: int) -> dict[str, Any]:
    """Stack blocks into ``[B, T]`` tensors, a short (last) block padded with ``pad_index`` on the right."""
    size = max(len(sample["source"]) for sample in samples)
    source = torch.full((len(samples), size), pad_index, dtype=torch.long)
    target = torch.full((len(samples), size), pad_index, dtype=torch.long)
    for row, sample in enumerate(samples):
        length = len(sample["source"])
        source[row, :length] = sample["source"]
        target[row, :length] = sample["target"]
    return {
        "id": torch.tensor([sample["id"] for sample in samples]),
        "net_input": {"src_tokens": source},
        "target": target,
        "ntokens": int((target != pad_index).sum()),
        "nsentences": len(samples),
    }

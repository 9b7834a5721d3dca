"""Tokenized labelled sentences, and batches of them padded to their longest sentence (dynamic padding).

The dataset's ``sizes`` (tokens per sentence) make the batch plan order each update's
sentences by length (see :func:`hetfair.data.batch_plan.by_length_within_updates`), so a batch
holds sentences of similar length and little padding.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from hetfair.classification.tokenization import Encoded


class LabelledSentences(Dataset):
    """Sentence ``i``: its index, token ids and segment ids (special tokens included) and its class index."""

    def __init__(self, encoded: Encoded, targets: np.ndarray) -> None:
        self.encoded = encoded
        self.targets = targets
        self.sizes = encoded.sizes

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> dict[str, Any]:
        start, end = self.encoded.offsets[index], self.encoded.offsets[index + 1]
        return {"id": index, "input_ids": torch.from_numpy(self.encoded.ids[start:end]),
                "token_type_ids": torch.from_numpy(self.encoded.type_ids[start:end]),
                "target": int(self.targets[index])}


def collate_sentences(samples: list[dict[str, Any]], pad_index: int) -> dict[str, Any]:
    """Pad to the batch's longest sentence: ``net_input`` with ``input_ids``, ``attention_mask`` (1 on real
    tokens) and ``token_type_ids``, all ``LongTensor[B, T]``; ``target`` ``LongTensor[B]``."""
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    size = int(lengths.max())
    input_ids = torch.full((len(samples), size), pad_index, dtype=torch.long)
    token_type_ids = torch.zeros((len(samples), size), dtype=torch.long)
    for row, sample in enumerate(samples):
        input_ids[row, :len(sample["input_ids"])] = sample["input_ids"]
        token_type_ids[row, :len(sample["token_type_ids"])] = sample["token_type_ids"]
    attention_mask = (torch.arange(size) < lengths[:, None]).long()
    return {
        "id": torch.tensor([s["id"] for s in samples]),
        "net_input": {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids},
        "target": torch.tensor([s["target"] for s in samples], dtype=torch.long),
        "nsentences": len(samples),
        "ntokens": int(lengths.sum()),
    }

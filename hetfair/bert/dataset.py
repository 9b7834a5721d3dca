"""BERT training samples: packed sentence blocks, optional sentence pairs, dynamic masks.

Blocks are fixed once (consecutive sentences of one document, packed up to the
token budget); everything random about a sample (the NSP split and partner, the
masks) is drawn from a generator seeded by ``(seed, epoch, index)``, so a sample
is the same whichever rank, batch or DataLoader worker produces it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from hetfair.data.indexed_dataset import IndexedDataset
from hetfair.bert.masking import IGNORE_INDEX, MaskingConfig, mask_tokens
from hetfair.bert.tokenizer import Vocabulary
from hetfair.errors import ConfigError, DataError

IS_NEXT, NOT_NEXT = 0, 1  # NSP labels, as in Google's BERT and Hugging Face


_CHUNK_SENTENCES = 1 << 18
"""Sentences packed per vectorized pass (whole documents; bounds the temporary arrays to a few MB)."""
_VECTOR_MIN_DOCUMENTS = 64
"""Below this many documents still being packed, the rest are walked in Python (few long documents)."""


def build_blocks(offsets: np.ndarray, document_index: np.ndarray, budget: int, min_tokens: int = 1
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Greedily pack each document's consecutive sentences into token ranges of at most ``budget``.

    A sentence longer than ``budget`` is cut into ``budget``-sized pieces. Ranges
    shorter than ``min_tokens`` are dropped. Returns ``(blocks, documents)``:
    ``blocks[i] = (start, end)`` token offsets and ``documents[i]`` its document.

    Vectorized: a block starting at token ``p`` ends at the last sentence end of its
    document within ``p + budget`` (or, when the sentence at ``p`` is longer than the
    budget, after its ``budget``-sized pieces and the sentences that fit behind the
    last piece), so the next sentence each sentence start leads to is computed for all
    sentences at once, and every document's chain is followed in parallel. Documents
    are processed in chunks of about 250,000 sentences; ``offsets`` and
    ``document_index`` may be memory maps.
    """
    if budget < 1:
        raise ValueError(f"block budget must be at least 1 token, got {budget}")
    document_index = np.asarray(document_index, dtype=np.int64)
    n_documents = len(document_index) - 1
    all_blocks, all_documents = [], []
    first_document = 0
    while first_document < n_documents:
        base = int(document_index[first_document])
        end_document = int(np.searchsorted(document_index, base + _CHUNK_SENTENCES, "right")) - 1
        end_document = min(max(end_document, first_document + 1), n_documents)
        blocks, documents = _pack_chunk(offsets, document_index[first_document:end_document + 1], budget)
        keep = blocks[:, 1] - blocks[:, 0] >= min_tokens
        all_blocks.append(blocks[keep])
        all_documents.append(documents[keep] + first_document)
        first_document = end_document
    # one array each, freeing every chunk's part once copied (peak: the result and one part, not twice the result)
    total = sum(len(part) for part in all_blocks)
    blocks, documents = np.empty((total, 2), dtype=np.int64), np.empty(total, dtype=np.int64)
    at = 0
    all_blocks.reverse()
    all_documents.reverse()
    while all_blocks:
        part, part_documents = all_blocks.pop(), all_documents.pop()
        blocks[at:at + len(part)], documents[at:at + len(part)] = part, part_documents
        at += len(part)
    return blocks, documents


def _pack_chunk(offsets: np.ndarray, document_index: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """All blocks (unfiltered) of the documents ``document_index`` delimits, documents numbered from 0."""
    base, top = int(document_index[0]), int(document_index[-1])
    bounds = np.asarray(offsets[base:top + 1], dtype=np.int64)  # sentence i: bounds[i]..bounds[i + 1]
    starts, ends = document_index[:-1] - base, document_index[1:] - base  # per document, in sentences
    lengths = ends - starts
    n = top - base
    # the document of each sentence and its last bound
    sentence_document = np.repeat(np.arange(len(starts)), lengths)
    last = ends[sentence_document]
    position = bounds[:n]
    # a block starting at each sentence start: the last sentence end within the budget
    target = np.minimum(np.searchsorted(bounds, position + budget, "right") - 1, last)
    simple = bounds[target] > position
    pieces = np.zeros(n, dtype=np.int64)  # budget-sized pieces cut before the block that ends at bounds[target]
    long = np.flatnonzero(~simple)
    if len(long):
        p, doc_last = position[long], last[long]
        at_end = bounds[doc_last] <= p  # only empty sentences left: one empty block to the document end
        following = np.minimum(np.searchsorted(bounds, p, "right"), doc_last)
        cuts = np.where(at_end, 0, (bounds[following] - p - 1) // budget)
        rest = p + cuts * budget
        target[long] = np.minimum(np.searchsorted(bounds, rest + budget, "right") - 1, doc_last)
        target[long[at_end]] = doc_last[at_end]
        pieces[long] = cuts
    # follow every document's chain of block starts, all documents in parallel
    visited = np.zeros(n, dtype=bool)
    current, stop = starts[lengths > 0], ends[lengths > 0]
    while len(current) >= _VECTOR_MIN_DOCUMENTS:
        visited[current] = True
        current = target[current]
        more = current < stop
        current, stop = current[more], stop[more]
    for node, end in zip(current.tolist(), stop.tolist()):  # a few (long) documents left: walk them in Python
        following = target[node:end].tolist()
        low = node
        while node < end:
            visited[node] = True
            node = following[node - low]
    nodes = np.flatnonzero(visited)
    # each visited start gives its pieces and one block to bounds[target]
    counts = pieces[nodes] + 1
    first = np.cumsum(counts) - counts
    within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(first, counts)
    block_starts = np.repeat(position[nodes], counts) + within * budget
    block_ends = block_starts + budget
    block_ends[first + counts - 1] = bounds[target[nodes]]
    documents = np.repeat(sentence_document[nodes], counts)
    empty = np.flatnonzero(lengths == 0)
    if len(empty):  # a document without sentences is one empty block (dropped unless min_tokens <= 0)
        at = bounds[starts[empty]]
        block_starts = np.concatenate([block_starts, at])
        block_ends = np.concatenate([block_ends, at])
        order = np.argsort(np.concatenate([documents, empty]), kind="stable")
        documents = np.concatenate([documents, empty])[order]
        block_starts, block_ends = block_starts[order], block_ends[order]
    return np.stack([block_starts, block_ends], axis=1), documents


class BertDataset(Dataset):
    """``[CLS] A [SEP]`` blocks, or ``[CLS] A [SEP] B [SEP]`` pairs with ``nsp``, dynamically masked.

    Args:
        data: the binarized split.
        vocab: its vocabulary (special token ids).
        tokens_per_sample: longest sample, special tokens included.
        masking: masking probabilities.
        seed: base seed of every random draw.
        nsp: build sentence pairs for next-sentence prediction; B is the true
            continuation of A or (probability 1/2) a block of another document.
    """

    def __init__(self, data: IndexedDataset, vocab: Vocabulary, tokens_per_sample: int,
                 masking: MaskingConfig, seed: int, nsp: bool) -> None:
        specials = 3 if nsp else 2
        if tokens_per_sample <= specials:
            raise ConfigError(f"--tokens-per-sample must exceed {specials}, got {tokens_per_sample}")
        self.data = data
        self.vocab = vocab
        self.masking = masking
        self.seed = seed
        self.nsp = nsp
        self.epoch = 1
        self.blocks, block_documents = build_blocks(
            data.sentence_offsets, data.document_index, tokens_per_sample - specials, min_tokens=2 if nsp else 1
        )
        if len(self.blocks) == 0:
            raise DataError(f"{data.prefix} yields no training samples")
        # Blocks of one document are contiguous: document d owns blocks [first[d], first[d + 1]).
        self._block_documents = block_documents
        self._document_first_block = np.searchsorted(block_documents, np.arange(data.num_documents + 1))
        special = np.zeros(len(vocab), dtype=bool)
        special[list(vocab.special_ids)] = True
        self._special = special
        self._regular_ids = np.flatnonzero(~special)

    def set_epoch(self, epoch: int) -> None:
        """Redraw masks (and NSP pairs) for ``epoch``."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        rng = np.random.default_rng([self.seed, self.epoch, index])
        v = self.vocab
        if self.nsp:
            a, b, nsp_label = self._sentence_pair(index, rng)
            ids = np.concatenate([[v.cls], a, [v.sep], b, [v.sep]])
        else:
            start, end = self.blocks[index]
            a = self.data.tokens[start:end]
            ids = np.concatenate([[v.cls], a, [v.sep]])
        ids = ids.astype(np.int64)
        token_types = np.zeros(len(ids), dtype=np.int64)
        token_types[len(a) + 2:] = 1
        inputs, labels = mask_tokens(ids, ~self._special[ids], self.masking, v.mask, self._regular_ids, rng)
        item = {
            "input_ids": torch.from_numpy(inputs),
            "token_type_ids": torch.from_numpy(token_types),
            "labels": torch.from_numpy(labels),
        }
        if self.nsp:
            item["nsp_label"] = torch.tensor(nsp_label)
        return item

    def _sentence_pair(self, index: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, int]:
        """Split block ``index`` into A and B (at a sentence boundary when it has one)."""
        start, end = (int(x) for x in self.blocks[index])
        offsets = self.data.sentence_offsets
        inner = offsets[np.searchsorted(offsets, start, "right"):np.searchsorted(offsets, end, "left")]
        split = int(rng.choice(inner)) if len(inner) else int(rng.integers(start + 1, end))
        tokens = self.data.tokens
        a, b = tokens[start:split], tokens[split:end]
        if rng.random() < 0.5:
            return a, b, IS_NEXT
        other_start, other_end = self.blocks[self._block_elsewhere(index, rng)]
        return a, tokens[other_start:min(other_end, other_start + len(b))], NOT_NEXT

    def _block_elsewhere(self, index: int, rng: np.random.Generator) -> int:
        """A uniformly random block of another document (any block if there is only one document)."""
        document = self._block_documents[index]
        first, end = self._document_first_block[document], self._document_first_block[document + 1]
        others = len(self.blocks) - (end - first)
        if others == 0:
            return int(rng.integers(len(self.blocks)))
        pick = int(rng.integers(others))
        return pick + (end - first) if pick >= first else pick


def collate_bert(samples: list[dict[str, torch.Tensor]], pad_id: int) -> dict[str, Any]:
    """Pad samples to the longest; labels are -100 wherever nothing is predicted."""
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    size = int(lengths.max())

    def stack(key: str, fill: int) -> torch.Tensor:
        out = torch.full((len(samples), size), fill, dtype=torch.long)
        for row, sample in zip(out, samples):
            row[:len(sample[key])] = sample[key]
        return out

    attention_mask = torch.arange(size) < lengths[:, None]  # true on real tokens
    batch: dict[str, Any] = {
        "net_input": {
            "input_ids": stack("input_ids", pad_id),
            "token_type_ids": stack("token_type_ids", 0),
            "attention_mask": attention_mask,
        },
        "target": stack("labels", IGNORE_INDEX),
        "nsentences": len(samples),
        "ntokens": int(attention_mask.sum()),
    }
    if "nsp_label" in samples[0]:
        batch["nsentence_labels"] = torch.stack([s["nsp_label"] for s in samples])
    return batch

"""The greedy Python loop that ``hetfair.bert.dataset.build_blocks`` replaced: the reference for its test
and the "before" of ``bench_bert_data.py``."""

from __future__ import annotations

from itertools import pairwise

import numpy as np


def reference_blocks(offsets: np.ndarray, document_index: np.ndarray, budget: int, min_tokens: int = 1
                     ) -> tuple[np.ndarray, np.ndarray]:
    """The original loop: pack each document's sentences greedily, cutting longer ones into budget pieces."""
    blocks: list[tuple[int, int]] = []
    documents: list[int] = []

    def emit(start: int, end: int, document: int) -> None:
        if end - start >= min_tokens:
            blocks.append((start, end))
            documents.append(document)

    for document in range(len(document_index) - 1):
        first, last = int(document_index[document]), int(document_index[document + 1])
        bounds = offsets[first:last + 1].tolist()
        start = bounds[0]
        for sentence_start, sentence_end in pairwise(bounds):
            if sentence_end - start <= budget:
                continue
            if sentence_start > start:
                emit(start, sentence_start, document)
                start = sentence_start
            while sentence_end - start > budget:
                emit(start, start + budget, document)
                start += budget
        emit(start, bounds[-1], document)
    return np.array(blocks, dtype=np.int64).reshape(-1, 2), np.array(documents, dtype=np.int64)

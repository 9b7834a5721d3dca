"""Block building: the vectorized ``build_blocks`` equals the plain greedy loop it replaced."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from hetfair.bert import dataset
from hetfair.bert.dataset import build_blocks

_SHARED = str(Path(__file__).resolve().parents[1] / "benchmarks")  # block_reference.py, shared with the benchmark
if _SHARED not in sys.path:
    sys.path.append(_SHARED)

from block_reference import reference_blocks  # noqa: E402


def random_corpus(rng: np.random.Generator, n_documents: int, max_sentences: int, max_length: int,
                  empty_sentences: bool) -> tuple[np.ndarray, np.ndarray]:
    sentences = rng.integers(0, max_sentences + 1, n_documents)  # some documents have none
    lengths = rng.integers(0 if empty_sentences else 1, max_length + 1, int(sentences.sum()))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    document_index = np.concatenate([[0], np.cumsum(sentences)]).astype(np.int64)
    return offsets, document_index


def assert_same(offsets: np.ndarray, document_index: np.ndarray, budget: int, min_tokens: int) -> None:
    expected = reference_blocks(offsets, document_index, budget, min_tokens)
    actual = build_blocks(offsets, document_index, budget, min_tokens)
    np.testing.assert_array_equal(actual[0], expected[0])
    np.testing.assert_array_equal(actual[1], expected[1])
    assert actual[0].dtype == actual[1].dtype == np.int64 and actual[0].shape[1:] == (2,)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("min_tokens", [0, 1, 2, 5])
def test_vectorized_blocks_equal_the_loop(seed: int, min_tokens: int) -> None:
    rng = np.random.default_rng(seed)
    budget = int(rng.choice([1, 2, 3, 7, 16, 30, 126]))
    max_length = int(rng.choice([1, 5, 40, 300]))  # 300: many sentences longer than the budget
    offsets, document_index = random_corpus(rng, int(rng.integers(1, 400)), int(rng.integers(0, 30)),
                                            max_length, empty_sentences=bool(seed % 2))
    assert_same(offsets, document_index, budget, min_tokens)


@pytest.mark.parametrize("min_tokens", [0, 1, 2])
def test_edge_cases(min_tokens: int) -> None:
    cases = [
        ([0], [0]),  # no document
        ([0], [0, 0]),  # one document without sentences
        ([0, 5], [0, 1]),  # one sentence within the budget
        ([0, 10], [0, 1]),  # exactly the budget
        ([0, 11], [0, 1]),  # one token over
        ([0, 35], [0, 1]),  # several pieces
        ([0, 30], [0, 1]),  # pieces that end exactly on the sentence end
        ([0, 0, 0, 25, 25, 27], [0, 0, 3, 3, 5, 5]),  # empty sentences and documents between
        ([0, 3, 20, 22, 40, 41], [0, 5]),  # long sentences between short ones
        ([0, 4, 8, 12], [0, 1, 2, 3]),  # one sentence per document
    ]
    for offsets, document_index in cases:
        assert_same(np.array(offsets, dtype=np.int64), np.array(document_index, dtype=np.int64), 10, min_tokens)


def test_chunks_and_the_python_walk_give_the_same_blocks(monkeypatch) -> None:
    rng = np.random.default_rng(7)
    offsets, document_index = random_corpus(rng, 3000, 40, 60, empty_sentences=True)
    expected = reference_blocks(offsets, document_index, 50, 2)
    for chunk, vector_min in [(1, 1), (100, 64), (5000, 10_000), (10**9, 1)]:  # tiny chunks, all walked, ...
        monkeypatch.setattr(dataset, "_CHUNK_SENTENCES", chunk)
        monkeypatch.setattr(dataset, "_VECTOR_MIN_DOCUMENTS", vector_min)
        actual = build_blocks(offsets, document_index, 50, 2)
        np.testing.assert_array_equal(actual[0], expected[0])
        np.testing.assert_array_equal(actual[1], expected[1])


def test_document_index_may_start_after_the_first_sentence() -> None:
    offsets = np.array([0, 4, 9, 30, 33, 40], dtype=np.int64)
    assert_same(offsets, np.array([1, 3, 5], dtype=np.int64), 8, 1)


def test_memory_mapped_index_is_accepted(tmp_path) -> None:
    rng = np.random.default_rng(3)
    offsets, document_index = random_corpus(rng, 200, 20, 50, empty_sentences=False)
    np.save(tmp_path / "o.npy", offsets)
    np.save(tmp_path / "d.npy", document_index)
    mapped = np.load(tmp_path / "o.npy", mmap_mode="r"), np.load(tmp_path / "d.npy", mmap_mode="r")
    expected = reference_blocks(offsets, document_index, 40, 2)
    actual = build_blocks(*mapped, 40, 2)
    np.testing.assert_array_equal(actual[0], expected[0])
    np.testing.assert_array_equal(actual[1], expected[1])

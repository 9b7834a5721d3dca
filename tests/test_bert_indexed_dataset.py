"""The binary token dataset is read through memory maps, never loaded whole."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from hetfair.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from hetfair.errors import DataError


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def build(prefix: Path, documents: list[list[list[int]]], dtype=np.uint16) -> None:
    builder = IndexedDatasetBuilder(str(prefix), np.dtype(dtype))
    for document in documents:
        for sentence in document:
            builder.add_sentence(np.array(sentence))
        builder.end_document()
    builder.finalize()


def test_sentences_and_documents_read_back(tmp_path: Path) -> None:
    documents = [[[5, 6, 7], [8]], [[9, 10]], [], [[4464, 1, 2, 3]]]
    build(tmp_path / "d", documents)
    data = IndexedDataset(str(tmp_path / "d"))
    sentences = [s for d in documents for s in d]
    assert [data[i].tolist() for i in range(len(data))] == sentences
    assert data.num_documents == 3  # the empty document leaves no trace
    assert data.document_index.tolist() == [0, 2, 3, 4]
    assert np.fromfile(tmp_path / "d.bin", dtype=np.uint16).tolist() == [t for s in sentences for t in s]


def test_large_file_is_memory_mapped_not_loaded(tmp_path: Path) -> None:
    sentence = np.arange(1_000_000, dtype=np.int64) % 60000
    build(tmp_path / "big", [[sentence] * 100])  # 100M tokens, 200 MB
    before = rss_bytes()
    data = IndexedDataset(str(tmp_path / "big"))
    picked = [data[i] for i in (0, 37, 99)]
    assert all(isinstance(item, np.memmap) for item in picked)
    assert int(picked[1][123_456]) == 123_456 % 60000 and len(data) == 100 and data.num_tokens == 100_000_000
    assert rss_bytes() - before < 40 * 2**20


def test_pickling_sends_the_path_not_the_data(tmp_path: Path) -> None:
    build(tmp_path / "d", [[list(range(100_000))]], dtype=np.int32)
    data = IndexedDataset(str(tmp_path / "d"))
    blob = pickle.dumps(data)
    assert len(blob) < 1000
    assert np.array_equal(pickle.loads(blob)[0], data[0])


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.with_suffix(".idx").write_bytes(b"garbage" * 10), "not a hetfair index"),
    (lambda p: p.with_suffix(".idx").write_bytes(p.with_suffix(".idx").read_bytes()[:-8]), "truncated"),
    (lambda p: p.with_suffix(".bin").write_bytes(p.with_suffix(".bin").read_bytes()[:-2]), "does not match"),
    (lambda p: p.with_suffix(".bin").unlink(), "missing data file"),
])
def test_damaged_files_raise_data_error(tmp_path: Path, damage, message) -> None:
    build(tmp_path / "d", [[[1, 2, 3]], [[4, 5]]])
    damage(tmp_path / "d.x")
    with pytest.raises(DataError, match=message):
        IndexedDataset(str(tmp_path / "d"))

"""Binary token datasets read through memory maps: ``PREFIX.bin`` + ``PREFIX.idx``.

``PREFIX.bin`` holds the token ids of every sentence back to back (``uint16``
when the vocabulary has fewer than 65,536 tokens, else ``int32``).
``PREFIX.idx`` holds a header and two little-endian ``int64`` arrays:

* ``sentence_offsets`` (n_sentences + 1): sentence ``i`` is tokens
  ``[offsets[i], offsets[i+1])``;
* ``document_index`` (n_documents + 1): document ``d`` is sentences
  ``[document_index[d], document_index[d+1])``.

Both files are opened with :class:`numpy.memmap`, so a dataset of any size
costs only the pages actually read.
"""

from __future__ import annotations

import os
from array import array
from typing import Any

import numpy as np

from hetfair.errors import DataError

_MAGIC = b"HETFIDX\x00"
_VERSION = 1
_HEADER = np.dtype([("version", "<i8"), ("dtype", "<i8"), ("sentences", "<i8"), ("documents", "<i8")])
_DTYPE_CODES = {1: np.dtype(np.uint16), 2: np.dtype(np.int32)}


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Smallest supported token dtype for ids ``< vocab_size``."""
    return _DTYPE_CODES[1] if vocab_size < 2**16 else _DTYPE_CODES[2]


def _dtype_code(dtype: np.dtype) -> int:
    for code, known in _DTYPE_CODES.items():
        if known == dtype:
            return code
    raise ValueError(f"unsupported token dtype {dtype}")


class IndexedDatasetBuilder:
    """Writes sentences and document boundaries to ``PREFIX.bin`` / ``PREFIX.idx``.

    The ``.bin`` file is streamed to disk; only the offsets are kept in memory.
    """

    def __init__(self, prefix: str, dtype: np.dtype) -> None:
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        self._bin = open(prefix + ".bin", "wb")  # noqa: SIM115 - written by add_sentence, closed by finalize
        self._offsets = array("q", [0])
        self._documents = array("q", [0])

    def add_sentence(self, ids: np.ndarray) -> None:
        """Append one sentence (an empty one is skipped)."""
        if len(ids) == 0:
            return
        self._bin.write(np.asarray(ids, dtype=self.dtype).tobytes())
        self._offsets.append(self._offsets[-1] + len(ids))

    def end_document(self) -> None:
        """Close the current document (no-op when it has no sentence)."""
        if len(self._offsets) - 1 > self._documents[-1]:
            self._documents.append(len(self._offsets) - 1)

    @property
    def num_sentences(self) -> int:
        return len(self._offsets) - 1

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    @property
    def num_documents(self) -> int:
        return len(self._documents) - 1

    def discard(self) -> None:
        """Give up: close and delete whatever was written (after a failure)."""
        self._bin.close()
        for suffix in (".bin", ".idx"):
            if os.path.exists(self.prefix + suffix):
                os.remove(self.prefix + suffix)

    def finalize(self) -> None:
        """End the last document and write the index."""
        self.end_document()
        self._bin.close()
        header = np.array(
            [(_VERSION, _dtype_code(self.dtype), self.num_sentences, self.num_documents)], dtype=_HEADER
        )
        with open(self.prefix + ".idx", "wb") as f:
            f.write(_MAGIC)
            f.write(header.tobytes())
            f.write(np.frombuffer(self._offsets, dtype=np.int64).astype("<i8").tobytes())
            f.write(np.frombuffer(self._documents, dtype=np.int64).astype("<i8").tobytes())


class IndexedDataset:
    """Read-only view of a ``PREFIX.bin`` / ``PREFIX.idx`` pair; item ``i`` is sentence ``i``.

    Items are slices of a :class:`numpy.memmap`. Pickling (e.g. to DataLoader
    worker processes) sends only the prefix; the maps are reopened on arrival.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._open()

    def _open(self) -> None:
        idx_path, bin_path = self.prefix + ".idx", self.prefix + ".bin"
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise DataError(f"missing data file {path}")
        header_size = len(_MAGIC) + _HEADER.itemsize
        with open(idx_path, "rb") as f:
            head = f.read(header_size)
        if len(head) < header_size or not head.startswith(_MAGIC):
            raise DataError(f"{idx_path} is not a hetfair index file; create it with hetfair-preprocess")
        header = np.frombuffer(head[len(_MAGIC):], dtype=_HEADER)[0]
        if header["version"] != _VERSION or int(header["dtype"]) not in _DTYPE_CODES:
            raise DataError(f"{idx_path} has an unsupported version or dtype; recreate it with hetfair-preprocess")
        n_sentences, n_documents = int(header["sentences"]), int(header["documents"])
        expected = header_size + 8 * (n_sentences + 1 + n_documents + 1)
        if os.path.getsize(idx_path) != expected:
            raise DataError(f"{idx_path} is truncated or corrupt ({os.path.getsize(idx_path)} bytes, expected {expected})")
        self.dtype = _DTYPE_CODES[int(header["dtype"])]
        self.sentence_offsets = np.memmap(idx_path, dtype="<i8", mode="r", offset=header_size,
                                          shape=(n_sentences + 1,))
        self.document_index = np.memmap(idx_path, dtype="<i8", mode="r",
                                        offset=header_size + 8 * (n_sentences + 1), shape=(n_documents + 1,))
        n_tokens = int(self.sentence_offsets[-1])
        if os.path.getsize(bin_path) != n_tokens * self.dtype.itemsize:
            raise DataError(f"{bin_path} does not match its index ({n_tokens} tokens expected); recreate both")
        self.tokens = np.memmap(bin_path, dtype=self.dtype, mode="r", shape=(n_tokens,))

    def __getstate__(self) -> dict[str, Any]:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.prefix = state["prefix"]
        self._open()

    def __len__(self) -> int:
        return len(self.sentence_offsets) - 1

    def __getitem__(self, index: int) -> np.ndarray:
        return self.tokens[self.sentence_offsets[index]:self.sentence_offsets[index + 1]]

    @property
    def num_documents(self) -> int:
        return len(self.document_index) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def dataset_exists(prefix: str) -> bool:
    return os.path.isfile(prefix + ".idx") and os.path.isfile(prefix + ".bin")

"""Real text (Debian's ``jargon-text``), preprocessed directories and plain reference streams for the LM tests.

The reference stream of a corpus is made with Python's own text handling and the ``tokenizers``
library directly, so tests compare hetfair's ``datasets`` reading and binarizing against them,
not against hetfair itself.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from hetfair_cli.preprocess import main as preprocess_main

JARGON = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
EOS, PAD = "<|endoftext|>", "<pad>"


def jargon_paragraphs() -> list[str]:
    """The Jargon File's paragraphs (blank-line separated, line breaks inside kept), in order."""
    if not JARGON.is_file():
        pytest.skip(f"{JARGON} is missing: apt-get install jargon-text (make test does)")
    text = gzip.decompress(JARGON.read_bytes()).decode("utf-8")
    return paragraphs(text)


def paragraphs(text: str) -> list[str]:
    """Documents of a plain-text corpus as the docs define them, split with plain Python."""
    return [part.strip("\r\n") for part in text.split("\n\n") if part.strip()]


def write_text(path: Path, documents: list[str]) -> Path:
    """``documents`` as paragraphs of a text file (gzipped when ``path`` ends in .gz)."""
    data = ("\n\n".join(documents) + "\n").encode("utf-8")
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def preprocess(destdir: Path, *flags: str) -> Path:
    """Run ``hetfair-preprocess --task language_modeling FLAGS --destdir DESTDIR``; return ``destdir``."""
    assert preprocess_main(["--task", "language_modeling", *flags, "--destdir", str(destdir)]) == 0
    return destdir


def reference_stream(tokenizer_file: Path, documents: list[str]) -> np.ndarray:
    """Every document's ids, each followed by the end-of-text id, by the tokenizers library alone."""
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    eos = tokenizer.token_to_id(EOS)
    ids = [[*encoding.ids, eos] for encoding in tokenizer.encode_batch(documents, add_special_tokens=False)]
    return np.concatenate(ids).astype(np.int64)


def small_corpus(tmp: Path) -> tuple[Path, list[str]]:
    """About 2,000 characters of the Jargon File preprocessed under ``tmp`` (a 300-token BPE, the same text as the
    validation split; some 60 blocks of 16 tokens), and its documents."""
    docs, size = [], 0
    for doc in jargon_paragraphs():
        docs.append(doc)
        size += len(doc)
        if size > 2000:
            break
    train = write_text(tmp / "train.txt", docs)
    return preprocess(tmp / "data", "--tokenizer", "bpe", "--vocab-size", "300", "--trainpref", str(train),
                      "--validpref", str(train)), docs

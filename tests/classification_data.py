"""A small labelled set made from Debian's Jargon File (``jargon-text``) for the sentence-classification tests.

Sentences are the file's prose lines; labels follow from the text by fixed rules, so a model can
learn them and the tests can recompute them: two classes (does the line hold a comma?) and three
(its number of words modulo 3). Sentence pairs take the next prose line as the second sentence.
The vocabulary is trained with the ``tokenizers`` library itself.
"""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path
from typing import Sequence

import pytest
from tokenizers import BertWordPieceTokenizer

JARGON = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def prose_lines(count: int, skip: int = 1000) -> list[str]:
    """``count`` prose lines of the Jargon File (at least six words, no table drawing), after ``skip`` of them
    (past the table of contents)."""
    if not JARGON.is_file():
        pytest.skip(f"{JARGON} is missing: apt-get install jargon-text (make test-data does)")
    with gzip.open(JARGON, "rt", encoding="utf-8") as f:
        lines = [" ".join(line.split()) for line in f]
    prose = [line for line in lines if len(line.split()) >= 6 and line.isascii() and not any(c in line for c in "|+=")]
    return prose[skip:skip + count]


def comma_label(text: str) -> int:
    """Two classes: 1 when the sentence holds a comma."""
    return int("," in text)


def length_label(text: str) -> int:
    """Three classes: the number of words modulo 3."""
    return len(text.split()) % 3


def rows(lines: Sequence[str], classes: int = 2, pairs: bool = False) -> list[dict[str, object]]:
    """Rows ``{"text", "label"}`` (and ``"second"`` with ``pairs``: the next line) of ``lines``."""
    label = comma_label if classes == 2 else length_label
    out: list[dict[str, object]] = []
    for i, text in enumerate(lines):
        row: dict[str, object] = {"text": text, "label": label(text)}
        if pairs:
            row["second"] = lines[(i + 1) % len(lines)]
        out.append(row)
    return out


def write_rows(path: Path, table: Sequence[dict[str, object]]) -> Path:
    """``table`` as CSV, TSV or JSON lines, by ``path``'s ending."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in table), encoding="utf-8")
        return path
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]), delimiter="\t" if path.suffix == ".tsv" else ",")
        writer.writeheader()
        writer.writerows(table)
    return path


def make_labelled_dir(directory: Path, train: int = 96, valid: int = 32, classes: int = 2, pairs: bool = False,
                      ending: str = ".csv") -> Path:
    """``directory`` with ``train`` and ``valid`` files of Jargon File lines (valid lines follow the training ones)."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = prose_lines(train + valid)
    write_rows(directory / f"train{ending}", rows(lines[:train], classes, pairs))
    write_rows(directory / f"valid{ending}", rows(lines[train:], classes, pairs))
    return directory


def jargon_vocab(path: Path, vocab_size: int = 400, lines: int = 2000) -> Path:
    """A lowercasing BERT ``vocab.txt`` trained on Jargon File prose with ``tokenizers``."""
    tokenizer = BertWordPieceTokenizer(lowercase=True)
    tokenizer.train_from_iterator(prose_lines(lines), vocab_size=vocab_size, special_tokens=SPECIALS,
                                  show_progress=False)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    path.write_text("".join(token + "\n" for token, _ in vocab), encoding="utf-8")
    return path

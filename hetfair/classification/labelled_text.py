"""Labelled text files read with Hugging Face ``datasets``: CSV, TSV and JSON lines, their columns and labels.

``datasets`` is optional (``pip install 'hetfair[classification]'``) and imported only here, when
a file is read. Labels are class names: a label's class index is its place in the task's
``label_names``, which the training file decides unless ``--label-names`` does (whole numbers
0..K-1 are their own index; any other labels are sorted).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
from tqdm import tqdm

from hetfair.errors import ConfigError, DataError

FORMATS = {".csv": ("csv", {}), ".tsv": ("csv", {"delimiter": "\t"}), ".jsonl": ("json", {}),
           ".json": ("json", {})}
"""File ending -> the ``datasets`` builder that reads it, and its options."""


@dataclass(frozen=True)
class Columns:
    """Which columns hold the text, the optional second text of a pair, and the label."""

    text: str
    pair: Optional[str]
    label: str

    def names(self) -> list[str]:
        return [self.text, *([self.pair] if self.pair else []), self.label]


@dataclass
class LabelledText:
    """The rows of one file: texts (and second texts of pairs) and raw labels."""

    path: str
    texts: list[str]
    pairs: Optional[list[str]]
    labels: list[Any]


def split_file(data_dir: Optional[str], split: str) -> str:
    """``DIR/split.csv`` (or ``.tsv``, ``.jsonl``, ``.json``) of ``--data DIR``."""
    if not data_dir:
        raise ConfigError(f"no file for split '{split}': give --data DIR holding {split}.csv (or .tsv, .jsonl), "
                          f"or --{split}-file FILE")
    found = [os.path.join(data_dir, split + ending) for ending in FORMATS
             if os.path.isfile(os.path.join(data_dir, split + ending))]
    if not found:
        raise DataError(f"--data {data_dir} has no {split}.csv, {split}.tsv or {split}.jsonl; add one, or give "
                        f"--{split}-file FILE")
    if len(found) > 1:
        raise DataError(f"--data {data_dir} has {' and '.join(map(os.path.basename, found))}: keep one")
    return found[0]


def read_labelled_text(path: str, columns: Columns) -> LabelledText:
    """The rows of ``path`` (format by its ending), every column checked to be present and filled."""
    ending = os.path.splitext(path)[1].lower()
    if ending not in FORMATS:
        raise DataError(f"{path}: unknown format; name it *.csv, *.tsv or *.jsonl")
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    table = _load(path, *FORMATS[ending])
    missing = [name for name in columns.names() if name not in table.column_names]
    if missing:
        raise DataError(f"{path} has no column {', '.join(map(repr, missing))} (its columns: "
                        f"{', '.join(table.column_names)}); name the right ones with --text-column, "
                        f"--text-pair-column and --label-column")
    if len(table) == 0:
        raise DataError(f"{path} holds no rows")
    texts = _text_column(table, columns.text, path)
    pairs = _text_column(table, columns.pair, path) if columns.pair else None
    labels = table[columns.label]
    _check_filled(labels, columns.label, path)
    return LabelledText(path, texts, pairs, labels)


def _load(path: str, builder: str, options: dict[str, Any]) -> Any:
    try:
        import datasets
    except ImportError:
        raise ConfigError("the sentence_classification task reads its files with Hugging Face datasets: "
                          "pip install 'hetfair[classification]'") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    _fork_tqdm_lock()
    try:
        return datasets.load_dataset(builder, data_files=path, split="train", **options)
    except Exception as exc:  # noqa: BLE001 - datasets wraps parser errors of every kind
        cause = exc.__cause__ or exc
        raise DataError(f"{path} cannot be read as {builder.upper()}: {str(cause).strip().splitlines()[-1]}") from exc


def _fork_tqdm_lock() -> None:
    """Give tqdm a lock of the fork context before ``datasets`` draws its (disabled) bars.

    The first bar makes tqdm's multiprocessing lock, a semaphore. In a rank that hetfair's launcher
    spawned, one of the spawn context is registered with the launcher's resource tracker, which
    reports it as leaked when the rank ends ("leaked semaphore objects"); one of the fork context
    is unlinked at creation (as :func:`hetfair.data.rank_batches.worker_context` explains).
    """
    if sys.platform.startswith("linux") and getattr(tqdm, "_lock", None) is None:
        tqdm.set_lock(multiprocessing.get_context("fork").RLock())


def _text_column(table: Any, name: str, path: str) -> list[str]:
    values = table[name]
    _check_filled(values, name, path)
    return [value if isinstance(value, str) else str(value) for value in values]


def _check_filled(values: Sequence[Any], name: str, path: str) -> None:
    empty = next((row for row, value in enumerate(values, start=1) if value is None), None)
    if empty is not None:
        raise DataError(f"{path}: row {empty} has no value in column '{name}'")


def label_names_of(data: LabelledText, num_classes: int) -> list[str]:
    """The class names a training file implies: 0..K-1 for whole-number labels, else its sorted labels."""
    labels = data.labels
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in labels):
        beyond = next(((row, v) for row, v in enumerate(labels, start=1) if not 0 <= v < num_classes), None)
        if beyond is not None:
            raise DataError(f"{data.path}: row {beyond[0]} has label {beyond[1]}, beyond --num-classes "
                            f"{num_classes} (labels 0..{num_classes - 1}); raise --num-classes or fix the label")
        return [str(i) for i in range(num_classes)]
    names = sorted({str(v) for v in labels})
    if len(names) != num_classes:
        shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
        raise DataError(f"{data.path} has {len(names)} distinct labels ({shown}) but --num-classes is {num_classes}; "
                        f"set --num-classes {len(names)}, or list the classes with --label-names")
    return names


def class_indices(data: LabelledText, label_names: Sequence[str]) -> np.ndarray:
    """Each row's class index: the place of its label in ``label_names``; an unknown label is an error."""
    index = {name: i for i, name in enumerate(label_names)}
    targets = np.empty(len(data.labels), dtype=np.int64)
    for row, value in enumerate(data.labels):
        target = index.get(str(value))
        if target is None:
            shown = ", ".join(label_names[:10]) + (", ..." if len(label_names) > 10 else "")
            raise DataError(f"{data.path}: row {row + 1} has label {value!r}, which is none of the "
                            f"{len(label_names)} classes of --num-classes/--label-names ({shown}); fix the label "
                            f"or the class list")
        targets[row] = target
    return targets

"""Documents of a text or JSON-lines file, read through Hugging Face ``datasets`` (local files only).

Plain text (``.txt``, any other name; ``.gz``/``.bz2``/``.xz``/``.zst`` are decompressed): a
document is a paragraph, the lines between blank lines, its line breaks kept. JSON lines
(``.json``/``.jsonl``, also compressed): a document is one record's ``text_field``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

from hetfair.data.preprocess_output import COMPRESSED_SUFFIXES, DECOMPRESSION_ERRORS, corrupt_input, is_compressed
from hetfair.errors import ConfigError, DataError

JSON_SUFFIXES = (".json", ".jsonl")


def is_json_lines(path: str) -> bool:
    """Whether ``path`` names a JSON-lines file (by its suffix, compression suffixes ignored)."""
    name = path.lower()
    for suffix in COMPRESSED_SUFFIXES:
        name = name.removesuffix(suffix)
    return name.endswith(JSON_SUFFIXES)


def documents(path: str, text_field: str) -> Iterator[str]:
    """The non-blank documents of ``path`` in file order, surrounding line breaks stripped."""
    try:
        for row in _stream(path, text_field):
            text = row.get(text_field)
            if text is None:
                raise DataError(f"{path}: a record has no '{text_field}' field (fields: {', '.join(sorted(row))}); "
                                f"choose the text with --text-field NAME")
            if not isinstance(text, str):
                raise DataError(f"{path}: field '{text_field}' holds {type(text).__name__}, not text; "
                                f"choose the text with --text-field NAME")
            text = text.strip("\r\n")
            if text.strip():
                yield text
    except (*DECOMPRESSION_ERRORS, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        if is_compressed(path) and isinstance(exc, DECOMPRESSION_ERRORS):
            raise corrupt_input(path, exc) from exc
        kind = "JSON lines" if is_json_lines(path) else "UTF-8 text"
        raise DataError(f"cannot read {path} as {kind}: {str(exc).splitlines()[0] if str(exc) else exc}") from exc


def _stream(path: str, text_field: str) -> Iterator[dict]:
    """The records of ``path`` as ``datasets`` streams them (no cache written, nothing downloaded)."""
    try:
        import datasets
    except ImportError as exc:
        raise ConfigError("reading text for --task language_modeling needs Hugging Face datasets: "
                          "pip install 'hetfair[lm]'") from exc
    if not os.path.isfile(path):
        raise DataError(f"input file {path} does not exist")
    files = {"train": str(Path(path).resolve())}
    if is_json_lines(path):
        return iter(datasets.load_dataset("json", data_files=files, split="train", streaming=True))
    if text_field != "text":
        raise ConfigError(f"--text-field {text_field} applies to JSON lines (.json/.jsonl); {path} is read as "
                          f"plain text")
    return iter(datasets.load_dataset("text", data_files=files, split="train", streaming=True,
                                      sample_by="paragraph"))

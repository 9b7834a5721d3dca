"""``hetfair-preprocess --task language_modeling``: text or JSON lines -> ``tokenizer.json`` + binary splits.

Documents (see :mod:`hetfair.lm.corpus`) are encoded with a byte-level BPE tokenizer trained on
the training split (``--tokenizer bpe --vocab-size N``), loaded from ``--tokenizer-file``, or the
one ``--destdir`` holds already, each followed by the end-of-text token, and written as one
sentence and one document each into ``SPLIT.bin``/``SPLIT.idx``
(:mod:`hetfair.data.indexed_dataset`). All or nothing: everything is written into a staging
directory inside ``--destdir`` and renamed into place once every split succeeded.
"""

from __future__ import annotations

import argparse
import os
from itertools import islice
from pathlib import Path
from typing import Iterator

import numpy as np
from tokenizers import Tokenizer

from hetfair.data.indexed_dataset import IndexedDatasetBuilder, dtype_for_vocab
from hetfair.data.preprocess_output import SPLIT_FLAGS, input_splits, staged_output
from hetfair.errors import ConfigError, DataError
from hetfair.lm.corpus import documents
from hetfair.lm.tokenizer import EOS_TOKEN, TOKENIZER_FILE, load_tokenizer, special_id, train_bpe
from hetfair.utils import DefaultsHelpFormatter

_DOCUMENTS_PER_BATCH = 1000
"""Documents encoded per ``encode_batch`` call (the tokenizers library parallelises within one)."""


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``hetfair-preprocess --task language_modeling`` (the console script adds ``--task``)."""
    parser = argparse.ArgumentParser(
        prog="hetfair-preprocess",
        description="Tokenize text or JSON lines (read through Hugging Face datasets) into memory-mapped binary "
                    "splits and a tokenizer.json for the language_modeling task.",
        allow_abbrev=False,
        formatter_class=DefaultsHelpFormatter,
    )
    for split, flag in SPLIT_FLAGS.items():
        parser.add_argument(f"--{flag}", metavar="FILE",
                            help=f"{split} text: plain text (paragraphs are documents) or JSON lines (.json/.jsonl)")
    parser.add_argument("--destdir", default="data-bin", metavar="DIR", help="output directory")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--tokenizer", choices=("bpe",), help="train a byte-level BPE tokenizer on --trainpref")
    source.add_argument("--tokenizer-file", metavar="JSON", help="use this tokenizers file (tokenizer.json)")
    parser.add_argument("--vocab-size", type=int, default=16384, metavar="N", help="size of a trained vocabulary")
    parser.add_argument("--text-field", default="text", metavar="NAME", help="the field of a JSON-lines record "
                        "that holds its text")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    return parser


def preprocess(args: argparse.Namespace) -> dict[str, dict[str, int]]:
    """Write ``tokenizer.json`` and every requested split into ``args.destdir``; return each split's counts."""
    splits = _check_args(args)
    destdir = Path(args.destdir)
    with staged_output(destdir) as staging:
        counts = _preprocess_into(args, splits, destdir, staging)
    for split, stats in counts.items():
        print(f"{split}: {stats['documents']} documents, {stats['tokens']} tokens -> {destdir / split}.bin")
    return counts


def _check_args(args: argparse.Namespace) -> dict[str, str]:
    """Every option checked before anything is read or written; returns split -> input file."""
    splits = input_splits(args)
    existing = Path(args.destdir) / TOKENIZER_FILE
    if existing.is_file() and (args.tokenizer or args.tokenizer_file):
        raise ConfigError(f"{args.destdir} already holds a tokenizer ({existing}); drop --tokenizer/--tokenizer-file "
                          f"to reuse it, or use a fresh --destdir")
    if not existing.is_file() and not (args.tokenizer or args.tokenizer_file):
        raise ConfigError("choose a tokenizer: --tokenizer bpe --vocab-size N to train one on --trainpref, "
                          "or --tokenizer-file tokenizer.json")
    if args.tokenizer and "train" not in splits:
        raise ConfigError("--tokenizer bpe trains on the training text: give --trainpref")
    return splits


def _preprocess_into(args: argparse.Namespace, splits: dict[str, str], destdir: Path,
                     staging: Path) -> dict[str, dict[str, int]]:
    """Binarize every split into ``staging`` with the tokenizer, then move them (and the tokenizer) into ``destdir``."""
    tokenizer = _tokenizer(args, splits)
    tokenizer.save(str(staging / TOKENIZER_FILE))
    counts = {split: binarize(path, args.text_field, staging / split, tokenizer) for split, path in splits.items()}
    for name in sorted(os.listdir(staging)):
        os.replace(staging / name, destdir / name)
    return counts


def _tokenizer(args: argparse.Namespace, splits: dict[str, str]) -> Tokenizer:
    if args.tokenizer:
        return train_bpe(documents(splits["train"], args.text_field), args.vocab_size)
    return load_tokenizer(Path(args.tokenizer_file or Path(args.destdir) / TOKENIZER_FILE))


def binarize(path: str, text_field: str, prefix: Path, tokenizer: Tokenizer) -> dict[str, int]:
    """Encode the documents of ``path`` into ``prefix.bin``/``.idx``, each ended by the end-of-text token.

    Special tokens written in the text (a literal ``<|endoftext|>``) are encoded as text, so only
    document ends are end-of-text tokens. On any failure neither file is left behind.
    """
    builder = IndexedDatasetBuilder(str(prefix), dtype_for_vocab(tokenizer.get_vocab_size(with_added_tokens=True)))
    eos = special_id(tokenizer, EOS_TOKEN)
    tokenizer.encode_special_tokens = True
    try:
        for batch in _batches(documents(path, text_field)):
            for encoding in tokenizer.encode_batch(batch, add_special_tokens=False):
                builder.add_sentence(np.append(np.asarray(encoding.ids, dtype=np.int64), eos))
                builder.end_document()
        builder.finalize()
        if builder.num_documents == 0:
            raise DataError(f"{path} contains no text")
    except BaseException:
        builder.discard()
        raise
    finally:
        tokenizer.encode_special_tokens = False
    return {"documents": builder.num_documents, "tokens": builder.num_tokens}


def _batches(items: Iterator[str]) -> Iterator[list[str]]:
    return iter(lambda: list(islice(items, _DOCUMENTS_PER_BATCH)), [])

"""Turn raw text into the binary splits and vocabulary that the ``bert`` task reads.

Input: one sentence (or paragraph) per line, a blank line between documents,
plain or ``.gz``. Output in ``--destdir``: ``SPLIT.bin`` / ``SPLIT.idx`` per
split, the vocabulary file, and ``preprocess.json`` recording which tokenizer
made them (see :mod:`hetfair.bert.data_dir`).
"""

from __future__ import annotations

import argparse
import gzip
import io
import multiprocessing
import os
import shutil
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict
from itertools import chain, islice
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

import numpy as np
from tqdm import tqdm

from hetfair.bert.data_dir import destdir_tokenizer_spec, read_metadata, write_metadata
from hetfair.data.indexed_dataset import IndexedDatasetBuilder, dtype_for_vocab
from hetfair.data.preprocess_output import DECOMPRESSION_ERRORS, SPLIT_FLAGS, corrupt_input, input_splits, staged_output
from hetfair.bert.tokenizer import (
    SPECIAL_TOKENS,
    TOKENIZER_KINDS,
    VOCAB_FILE_NAMES,
    Tokenizer,
    TokenizerSpec,
    check_same_vocabulary,
    load_tokenizer,
    train_tokenizer,
)
from hetfair.errors import ConfigError, DataError
from hetfair.utils import DefaultsHelpFormatter

_LINES_PER_CHUNK = 2000
T = TypeVar("T")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hetfair-preprocess",
        description="Tokenize raw text (one sentence per line, blank line between documents; .gz accepted) "
                    "into memory-mapped binary splits for the bert task.",
        allow_abbrev=False,
        formatter_class=DefaultsHelpFormatter,
    )
    for split, flag in SPLIT_FLAGS.items():
        parser.add_argument(f"--{flag}", metavar="FILE", help=f"raw text of the {split} split")
    parser.add_argument("--destdir", default="data-bin", metavar="DIR", help="output directory")
    vocab = parser.add_mutually_exclusive_group()
    vocab.add_argument("--dict", metavar="VOCAB_TXT", help="existing BERT WordPiece vocabulary (one token per line)")
    vocab.add_argument("--sentencepiece-model", metavar="MODEL", help="existing sentencepiece model")
    vocab.add_argument("--tokenizer", choices=TOKENIZER_KINDS, help="train a new vocabulary of this kind on --trainpref")
    parser.add_argument("--vocab-size", type=int, default=30522, metavar="N", help="size of a trained vocabulary")
    parser.add_argument("--lowercase", action=argparse.BooleanOptionalAction, default=None,
                        help="lowercase and strip accents (WordPiece; default on) or case-fold (trained sentencepiece)")
    parser.add_argument("--character-coverage", type=float, default=0.9995, metavar="FRACTION",
                        help="characters a trained sentencepiece vocabulary covers (1.0 for small alphabets)")
    parser.add_argument("--workers", type=int, default=1, metavar="N", help="tokenizing processes")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    return parser


def preprocess(args: argparse.Namespace) -> dict[str, Any]:
    """Write every requested split and the vocabulary into ``args.destdir``; return the metadata.

    All or nothing: the vocabulary (when trained or copied) and every split are written into a
    hidden staging directory inside ``destdir`` first and only renamed into place, with the new
    ``preprocess.json``, once every split succeeded. A failed run leaves the files already in
    ``destdir`` as they were, and no ``destdir`` at all if it made it.
    """
    splits = _check_args(args)
    with staged_output(args.destdir) as staging:
        metadata = _preprocess_into(args, splits, str(staging))
    for split in splits:
        stats = metadata["splits"][split]
        print(f"{split}: {stats['documents']} documents, {stats['sentences']} sentences, {stats['tokens']} "
              f"tokens ({100 * stats['unk'] / max(stats['tokens'], 1):.2f}% [UNK]) -> "
              f"{os.path.join(args.destdir, split)}.bin")
    return metadata


def _preprocess_into(args: argparse.Namespace, splits: dict[str, str], staging: str) -> dict[str, Any]:
    """Binarize every split into ``staging``, then move them and any new vocabulary into ``destdir``."""
    spec = _vocabulary_in_destdir(args, splits, staging)
    tokenizer = load_tokenizer(spec)
    metadata = read_metadata(args.destdir) or {"splits": {}}
    metadata["tokenizer"] = {**asdict(spec), "path": os.path.basename(spec.path)}
    metadata["vocab_size"] = len(tokenizer.vocab)
    for split, path in splits.items():
        metadata["splits"][split] = binarize(path, os.path.join(staging, split), tokenizer, args.workers)
    for name in sorted(os.listdir(staging)):
        os.replace(os.path.join(staging, name), os.path.join(args.destdir, name))
    write_metadata(args.destdir, metadata)
    return metadata


def _check_args(args: argparse.Namespace) -> dict[str, str]:
    """Every option checked before anything is read or written; returns split -> input file."""
    splits = input_splits(args)
    if args.workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {args.workers}")
    if args.vocab_size <= len(SPECIAL_TOKENS):
        raise ConfigError(f"--vocab-size must be larger than the {len(SPECIAL_TOKENS)} special tokens, "
                          f"got {args.vocab_size}")
    if not 0 < args.character_coverage <= 1:
        raise ConfigError(f"--character-coverage must be in (0, 1], got {args.character_coverage}")
    return splits



def _vocabulary_in_destdir(args: argparse.Namespace, splits: dict[str, str], staging: str) -> TokenizerSpec:
    """Reuse the vocabulary of ``destdir``, or copy or train one into ``staging`` (moved to ``destdir`` with
    the splits); return its spec."""
    existing = destdir_tokenizer_spec(args.destdir) if read_metadata(args.destdir) else None
    given = _given_spec(args)
    if given is None and existing is None:
        if args.tokenizer is None:
            raise ConfigError("choose a vocabulary: --dict VOCAB_TXT, --sentencepiece-model MODEL, "
                              "or --tokenizer wordpiece|sentencepiece --vocab-size N to train one")
        if "train" not in splits:
            raise ConfigError("--tokenizer trains a vocabulary on the training text: give --trainpref")
        lowercase = True if args.lowercase is None else args.lowercase
        return train_tokenizer(args.tokenizer, lambda: _training_text(splits["train"]), args.vocab_size, lowercase,
                               staging, args.character_coverage)
    if given is None:
        assert existing is not None
        if args.tokenizer is not None:
            raise ConfigError(f"{args.destdir} already holds a vocabulary ({existing.path}); drop --tokenizer "
                              "to reuse it, or use a fresh --destdir")
        if args.lowercase is not None and existing.kind == "wordpiece" and args.lowercase != existing.lowercase:
            raise ConfigError(f"{args.destdir} was made with lowercase={existing.lowercase}; "
                              "use a fresh --destdir to change casing")
        return existing
    given_tokenizer = load_tokenizer(given)
    if existing is not None:
        check_same_vocabulary(given_tokenizer, load_tokenizer(existing))
    target = os.path.join(args.destdir, VOCAB_FILE_NAMES[given.kind])
    if os.path.exists(target) and os.path.samefile(given.path, target):
        return TokenizerSpec(given.kind, target, given.lowercase)
    staged = os.path.join(staging, VOCAB_FILE_NAMES[given.kind])
    shutil.copyfile(given.path, staged)
    return TokenizerSpec(given.kind, staged, given.lowercase)


def _given_spec(args: argparse.Namespace) -> TokenizerSpec | None:
    if args.dict:
        return TokenizerSpec("wordpiece", args.dict, True if args.lowercase is None else args.lowercase)
    if args.sentencepiece_model:
        if args.lowercase is not None:
            raise ConfigError("--lowercase/--no-lowercase do not apply to an existing sentencepiece model: "
                              "its own normalisation decides casing")
        return TokenizerSpec("sentencepiece", args.sentencepiece_model, False)
    return None


# -- binarizing ------------------------------------------------------------------


def binarize(path: str, prefix: str, tokenizer: Tokenizer, workers: int) -> dict[str, Any]:
    """Tokenize the text file ``path`` into ``prefix.bin`` / ``prefix.idx``; return counts.

    On any failure neither file is left behind.
    """
    builder = IndexedDatasetBuilder(prefix, dtype_for_vocab(len(tokenizer.vocab)))
    try:
        unk = _add_text(builder, path, tokenizer, workers)
        builder.finalize()
        if builder.num_sentences == 0:
            raise DataError(f"{path} contains no text")
    except BaseException:
        builder.discard()
        raise
    return {"source": os.path.abspath(path), "documents": builder.num_documents,
            "sentences": builder.num_sentences, "tokens": builder.num_tokens, "unk": unk,
            "dtype": builder.dtype.name}


def _add_text(builder: IndexedDatasetBuilder, path: str, tokenizer: Tokenizer, workers: int) -> int:
    """Add every sentence and document of ``path`` to ``builder``; return the number of [UNK] tokens."""
    unk = 0
    with _open_text(path) as (lines, progress), _encoded_chunks(lines, tokenizer, workers) as chunks:
        for tokens, lengths in chunks:
            unk += int(np.count_nonzero(tokens == tokenizer.vocab.unk))
            start = 0
            for length in lengths.tolist():
                if length < 0:
                    builder.end_document()
                    continue
                builder.add_sentence(tokens[start:start + length])
                start += length
            progress()
    return unk


def encode_lines(tokenizer: Tokenizer, lines: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Encode a chunk of lines: (all token ids back to back, length per line with -1 for a blank line)."""
    stripped = [line.strip() for line in lines]
    nonblank = [i for i, line in enumerate(stripped) if line]
    ids = tokenizer.encode_batch([stripped[i] for i in nonblank])
    lengths = np.full(len(lines), -1, dtype=np.int64)
    lengths[nonblank] = [len(x) for x in ids]
    tokens = np.fromiter(chain.from_iterable(ids), dtype=np.int64, count=int(lengths[nonblank].sum()))
    return tokens, lengths


# One tokenizer per worker process, built once by the pool initializer: sending it
# with every chunk would reload the vocabulary for each chunk.
_worker_tokenizer: Tokenizer | None = None


def _init_worker(spec: TokenizerSpec) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    _worker_tokenizer = load_tokenizer(spec)


def _encode_in_worker(lines: list[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _worker_tokenizer is not None
    return encode_lines(_worker_tokenizer, lines)


@contextmanager
def _encoded_chunks(lines: Iterable[str], tokenizer: Tokenizer, workers: int) -> Iterator[Iterator[Any]]:
    chunks = iter(lambda: list(islice(lines, _LINES_PER_CHUNK)), [])
    if workers == 1:
        yield (encode_lines(tokenizer, chunk) for chunk in chunks)
        return
    with multiprocessing.get_context("spawn").Pool(workers, _init_worker, (tokenizer.spec,)) as pool:
        yield _ordered_map(pool, _encode_in_worker, chunks, max_pending=2 * workers)


def _ordered_map(pool: Any, fn: Callable[[Any], T], items: Iterable[Any], max_pending: int) -> Iterator[T]:
    """``pool.imap`` that reads ``items`` only ``max_pending`` ahead (bounded memory on huge files)."""
    pending: deque = deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= max_pending:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


@contextmanager
def _open_text(path: str) -> Iterator[tuple[Iterator[str], Callable[[], None]]]:
    """Lines of a UTF-8 (optionally gzipped) file and a callback advancing a byte progress bar."""
    with open(path, "rb") as raw, tqdm(total=os.path.getsize(path), unit="B", unit_scale=True,
                                       desc=os.path.basename(path), disable=None, leave=False) as bar:
        stream = gzip.GzipFile(fileobj=raw) if _gzipped(path) else raw
        with io.TextIOWrapper(stream, encoding="utf-8") as text:
            yield _checked_lines(text, path), lambda: bar.update(raw.tell() - bar.n)


def _gzipped(path: str) -> bool:
    return path.endswith(".gz")


def _checked_lines(text: io.TextIOWrapper, path: str) -> Iterator[str]:
    try:
        yield from text
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 text: {exc.reason} at byte {exc.start} of a read block") from exc
    except DECOMPRESSION_ERRORS as exc:
        raise (corrupt_input(path, exc) if _gzipped(path) else DataError(f"cannot read {path}: {exc}")) from exc


def _training_text(path: str) -> Iterator[str]:
    """The non-blank lines of ``path``, stripped: what a vocabulary is trained on."""
    with _open_text(path) as (lines, _):
        yield from (line.strip() for line in lines if line.strip())

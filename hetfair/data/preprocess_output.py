"""What every family's ``hetfair-preprocess`` shares: the split flags, the one error for a compressed input
that is truncated or corrupt, and an all-or-nothing output directory."""

from __future__ import annotations

import argparse
import lzma
import os
import shutil
import tempfile
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from hetfair.errors import ConfigError, DataError

SPLIT_FLAGS = {"train": "trainpref", "valid": "validpref", "test": "testpref"}
"""Each split and the ``hetfair-preprocess`` flag that names its raw input file."""


def input_splits(args: argparse.Namespace) -> dict[str, str]:
    """The splits given on the command line, each to its input file, checked to exist (and ``--destdir`` to be
    a directory, if it exists); before anything is read or written."""
    splits = {split: getattr(args, flag) for split, flag in SPLIT_FLAGS.items() if getattr(args, flag)}
    if not splits:
        raise ConfigError("nothing to do: give at least one of --trainpref, --validpref, --testpref")
    for path in splits.values():
        if not os.path.isfile(path):
            raise DataError(f"input file {path} does not exist")
    if os.path.exists(args.destdir) and not os.path.isdir(args.destdir):
        raise ConfigError(f"--destdir {args.destdir} is not a directory")
    return splits


COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")
"""Endings of input files that are decompressed as they are read."""

DECOMPRESSION_ERRORS = (EOFError, OSError, zlib.error, lzma.LZMAError)
"""What reading a truncated or corrupt compressed file raises: EOFError where the stream ends early (gzip, bz2, xz),
OSError for a bad header or checksum (gzip's BadGzipFile, bz2), zlib.error for a corrupt deflate block, LZMAError
for corrupt xz data."""


def is_compressed(path: str) -> bool:
    """Whether ``path`` is decompressed as it is read (by its ending)."""
    return path.lower().endswith(COMPRESSED_SUFFIXES)


def corrupt_input(path: str, exc: BaseException) -> DataError:
    """The one-line error for compressed input ``path`` that failed to decompress with ``exc``."""
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return DataError(f"{path} is truncated or corrupt: {detail}; replace it with a complete copy")


@contextmanager
def staged_output(destdir: str | Path) -> Iterator[Path]:
    """A hidden staging directory inside ``destdir`` (made if needed) to write every output into first.

    The caller renames the staged files into ``destdir`` once all of them are written. On any
    failure the staging directory goes, the files already in ``destdir`` stay as they were, and a
    ``destdir`` this run made is removed; a write error is one :class:`~hetfair.errors.DataError`.
    """
    destdir = Path(destdir)
    created = not destdir.is_dir()
    try:
        destdir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".preprocess-", dir=destdir))
    except OSError as exc:
        raise DataError(f"cannot write into --destdir {destdir}: {exc.strerror or exc}") from exc
    done = False
    try:
        yield staging
        done = True
    except OSError as exc:
        raise DataError(f"cannot write into {destdir}: {exc.strerror or exc}; the files already there are "
                        f"untouched") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if created and not done:
            shutil.rmtree(destdir, ignore_errors=True)

"""The directory ``hetfair-preprocess`` writes and the ``bert`` task reads.

It holds ``SPLIT.bin`` / ``SPLIT.idx`` per split (see
:mod:`hetfair.data.indexed_dataset`), the vocabulary file, and
:data:`METADATA_FILE` recording which tokenizer made them and what each split
contains.
"""

from __future__ import annotations

import json
import os
from typing import Any

from hetfair.bert.tokenizer import TokenizerSpec
from hetfair.errors import DataError

METADATA_FILE = "preprocess.json"


def read_metadata(destdir: str) -> dict[str, Any] | None:
    """The metadata of ``destdir``, or ``None`` when it has none (not a preprocessed directory yet)."""
    path = os.path.join(destdir, METADATA_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path} is corrupt ({exc}); rerun hetfair-preprocess into a fresh directory") from exc


def write_metadata(destdir: str, metadata: dict[str, Any]) -> None:
    """Replace ``destdir``'s metadata atomically (a crash leaves the old file or the new one)."""
    path = os.path.join(destdir, METADATA_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(metadata, f, indent=2)
    os.replace(path + ".tmp", path)


def destdir_tokenizer_spec(destdir: str) -> TokenizerSpec:
    """The tokenizer a preprocessed directory was made with."""
    metadata = read_metadata(destdir)
    if metadata is None:
        raise DataError(f"{destdir} is not a hetfair-preprocess output (no {METADATA_FILE}); run hetfair-preprocess")
    fields = metadata["tokenizer"]
    return TokenizerSpec(fields["kind"], os.path.join(destdir, fields["path"]), fields["lowercase"])

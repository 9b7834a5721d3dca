"""The model's own tokenizer for labelled text: a ``tokenizer.json``, a WordPiece ``vocab.txt``, a sentencepiece model.

A ``tokenizer.json`` is loaded with ``tokenizers``' ``Tokenizer.from_file`` (with its own
normaliser, pre-tokenizer and ``[CLS] A [SEP] B [SEP]``-style templates); a ``vocab.txt`` with
BERT's WordPiece (hetfair's vocabulary reader, ``tokenizers``' ``BertWordPieceTokenizer``); a
hetfair sentencepiece ``.model`` as the ``tokenizer.json`` it exports to (see
:mod:`hetfair.bert.hf_tokenizer`). Either way sentences and sentence pairs are encoded with
the special tokens and truncated (longest first, as ``transformers`` does) to the model's
longest input.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
from tokenizers import BertWordPieceTokenizer, Tokenizer

from hetfair.bert.hf_tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, VOCAB_FILE, hf_tokenizer_files, \
    sentencepiece_tokenizer
from hetfair.bert.tokenizer import SentencePieceTokenizer, TokenizerSpec, Vocabulary, read_vocab_file
from hetfair.errors import ConfigError, DataError

PAD_TOKENS = ("[PAD]", "<pad>")
"""Padding tokens looked up in a ``tokenizer.json`` that names none (BERT's, RoBERTa's)."""


@dataclass(frozen=True)
class Encoded:
    """Token ids and segment ids of every sentence (or pair), as one flat array each plus offsets."""

    ids: np.ndarray
    type_ids: np.ndarray
    offsets: np.ndarray

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)


class TextEncoder:
    """Text (or text pairs) -> token ids with the special tokens, truncated to ``max_length`` tokens."""

    def __init__(self, tokenizer: Any, pad_index: int, vocab_size: int, max_length: int,
                 hf_files: dict[str, str]) -> None:
        self._tokenizer = tokenizer
        self._tokenizer.no_padding()
        self._tokenizer.enable_truncation(max_length)
        self.pad_index = pad_index
        self.vocab_size = vocab_size
        self.max_length = max_length
        self.hf_files = hf_files
        """File name -> text of the Hugging Face tokenizer files that give the same ids (for export)."""

    def encode(self, texts: Sequence[str], pairs: Optional[Sequence[str]] = None) -> Encoded:
        inputs = list(texts) if pairs is None else list(zip(texts, pairs))
        encodings = self._tokenizer.encode_batch(inputs, add_special_tokens=True)
        lengths = np.array([len(e.ids) for e in encodings], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        ids = np.fromiter((i for e in encodings for i in e.ids), dtype=np.int64, count=int(offsets[-1]))
        type_ids = np.fromiter((t for e in encodings for t in e.type_ids), dtype=np.int64, count=int(offsets[-1]))
        return Encoded(ids, type_ids, offsets)


def tokenizer_file(path: str) -> str:
    """The tokenizer file of ``path``: the file itself, or a folder's ``tokenizer.json`` (else its ``vocab.txt``)."""
    if os.path.isdir(path):
        for name in (TOKENIZER_FILE, VOCAB_FILE):
            if os.path.isfile(os.path.join(path, name)):
                return os.path.join(path, name)
        raise ConfigError(f"--tokenizer {path}: the folder holds neither {TOKENIZER_FILE} nor {VOCAB_FILE}")
    if not os.path.isfile(path):
        raise ConfigError(f"--tokenizer {path}: no such file or folder")
    return path


def folder_config(path: str) -> dict[str, Any]:
    """The ``tokenizer_config.json`` beside a tokenizer file (``{}`` when there is none)."""
    config_path = os.path.join(os.path.dirname(path), TOKENIZER_CONFIG_FILE)
    if not os.path.isfile(config_path):
        return {}
    try:
        with open(config_path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{config_path} is not valid JSON: {exc}") from exc


def model_max_length(path: str) -> Optional[int]:
    """The longest input the tokenizer folder's ``tokenizer_config.json`` allows, if it names a real one."""
    value = folder_config(path).get("model_max_length")
    return int(value) if isinstance(value, (int, float)) and 0 < value < 1_000_000 else None


def load_text_encoder(path: str, lowercase: bool, max_length: int) -> TextEncoder:
    """The :class:`TextEncoder` of tokenizer file ``path`` (see :func:`tokenizer_file`)."""
    if path.endswith(".json"):
        return _json_encoder(path, max_length)
    if path.endswith(".model"):
        spec = TokenizerSpec("sentencepiece", path)
        vocab = SentencePieceTokenizer(spec).vocab
        files = hf_tokenizer_files(spec, vocab, max_length)
        return TextEncoder(sentencepiece_tokenizer(path, vocab), vocab.pad, len(vocab), max_length, files)
    tokens = read_vocab_file(path)
    vocab = Vocabulary.from_tokens(tokens, path)
    tokenizer = BertWordPieceTokenizer({token: i for i, token in enumerate(tokens)}, lowercase=lowercase)
    files = hf_tokenizer_files(TokenizerSpec("wordpiece", path, lowercase), vocab, max_length)
    return TextEncoder(tokenizer, vocab.pad, len(vocab), max_length, files)


def _json_encoder(path: str, max_length: int) -> TextEncoder:
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a plain Exception for any bad file
        raise DataError(f"--tokenizer {path} is not a tokenizers file: {str(exc).splitlines()[0]}") from exc
    config = folder_config(path)
    pad = _pad_index(tokenizer, config)
    if pad is None:
        raise DataError(f"--tokenizer {path} names no padding token (none of {', '.join(PAD_TOKENS)}, no "
                        f"pad_token in {TOKENIZER_CONFIG_FILE}); add one to the tokenizer")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    files = {TOKENIZER_FILE: text, TOKENIZER_CONFIG_FILE: json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", **config, "model_max_length": max_length}, indent=2)}
    return TextEncoder(tokenizer, pad, tokenizer.get_vocab_size(with_added_tokens=True), max_length, files)


def _pad_index(tokenizer: Tokenizer, config: dict[str, Any]) -> Optional[int]:
    if tokenizer.padding is not None:
        return int(tokenizer.padding["pad_id"])
    pad_token = config.get("pad_token")
    if isinstance(pad_token, dict):  # an AddedToken as transformers saves it
        pad_token = pad_token.get("content")
    for token in ([pad_token] if isinstance(pad_token, str) else []) + list(PAD_TOKENS):
        index = tokenizer.token_to_id(token)
        if index is not None:
            return int(index)
    return None

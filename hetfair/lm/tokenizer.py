"""The byte-level BPE tokenizer of a language-modelling data directory (Hugging Face ``tokenizers``).

Every tokenizer hetfair writes holds two special tokens: :data:`EOS_TOKEN`, which ends each
document in the token stream (GPT-2's), and :data:`PAD_TOKEN`, which fills the end of the last
block and is never predicted. A tokenizer loaded from a user's ``tokenizer.json`` gets whichever
of them it lacks appended to its vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from hetfair.errors import ConfigError, DataError

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<pad>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN)
TOKENIZER_FILE = "tokenizer.json"
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
"""A byte-level vocabulary holds every byte, so any text can be encoded, plus the special tokens."""


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer (GPT-2's scheme) of ``vocab_size`` tokens trained on ``texts``."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ConfigError(f"--vocab-size must be at least {MIN_VOCAB_SIZE} (256 bytes and the special tokens "
                          f"{', '.join(SPECIAL_TOKENS)}), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def load_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer saved at ``path`` (a ``tokenizer.json``), with hetfair's special tokens."""
    if not path.is_file():
        raise DataError(f"tokenizer file {path} does not exist")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust library raises a bare Exception for every parse error
        raise DataError(f"{path} is not a Hugging Face tokenizers file (tokenizer.json): {exc}") from exc
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))  # no-op for tokens it holds already
    return tokenizer


def special_id(tokenizer: Tokenizer, token: str) -> int:
    """The id of special ``token`` (one of :data:`SPECIAL_TOKENS`) in ``tokenizer``."""
    index = tokenizer.token_to_id(token)
    if index is None:
        raise DataError(f"the tokenizer has no {token} token; recreate the data with hetfair-preprocess")
    return index

"""BERT vocabularies: WordPiece (``tokenizers``) and sentencepiece, loaded or trained.

A :class:`TokenizerSpec` is the picklable recipe (kind, file, casing) that
worker processes use to rebuild a tokenizer; :func:`load_tokenizer` turns it
into a :class:`Tokenizer` whose :class:`Vocabulary` lists every token and the
ids of the special tokens BERT needs.
"""

from __future__ import annotations

import io
import os
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import sentencepiece as spm
from tokenizers import BertWordPieceTokenizer

from hetfair.errors import ConfigError, DataError

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
SPECIAL_TOKENS = (PAD, UNK, CLS, SEP, MASK)
TOKENIZER_KINDS = ("wordpiece", "sentencepiece")
# File names a vocabulary gets inside a preprocessed data directory.
VOCAB_FILE_NAMES = {"wordpiece": "vocab.txt", "sentencepiece": "sentencepiece.model"}


@dataclass(frozen=True)
class TokenizerSpec:
    """Which tokenizer to build: ``kind`` in :data:`TOKENIZER_KINDS`, its file, and casing.

    ``lowercase`` applies to WordPiece only; a sentencepiece model carries its own normalisation.
    """

    kind: str
    path: str
    lowercase: bool = True


@dataclass(frozen=True)
class Vocabulary:
    """Every token of a vocabulary, in id order, and the ids of the special tokens."""

    tokens: tuple[str, ...]
    pad: int
    unk: int
    cls: int
    sep: int
    mask: int

    @classmethod
    def from_tokens(cls, tokens: Sequence[str], source: str) -> "Vocabulary":
        """Find the special tokens in ``tokens``; missing ones are a :class:`DataError`."""
        index = {token: i for i, token in enumerate(tokens)}
        missing = [t for t in SPECIAL_TOKENS if t not in index]
        if missing:
            raise DataError(f"vocabulary {source} lacks the special tokens {' '.join(missing)} that BERT needs")
        return cls(tuple(tokens), *(index[t] for t in SPECIAL_TOKENS))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def special_ids(self) -> tuple[int, ...]:
        return (self.pad, self.unk, self.cls, self.sep, self.mask)


class Tokenizer:
    """Text <-> token ids with a BERT :class:`Vocabulary`."""

    spec: TokenizerSpec
    vocab: Vocabulary

    def encode_batch(self, lines: Sequence[str]) -> list[list[int]]:
        """Token ids of each line, without special tokens."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens are dropped."""
        raise NotImplementedError


class WordPieceTokenizer(Tokenizer):
    """BERT's WordPiece with its normaliser and pre-tokenizer, from a ``vocab.txt``."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec
        tokens = read_vocab_file(spec.path)
        self.vocab = Vocabulary.from_tokens(tokens, spec.path)
        self._tokenizer = BertWordPieceTokenizer(
            {token: i for i, token in enumerate(tokens)}, lowercase=spec.lowercase
        )

    def encode_batch(self, lines: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(list(lines), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids))


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model whose pieces include the BERT special tokens."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec
        if not os.path.isfile(spec.path):
            raise DataError(f"sentencepiece model {spec.path} does not exist")
        try:
            self._processor = spm.SentencePieceProcessor(model_file=spec.path)
        except (OSError, RuntimeError) as exc:
            raise DataError(f"cannot read sentencepiece model {spec.path}: {exc}") from exc
        pieces = [self._processor.id_to_piece(i) for i in range(self._processor.get_piece_size())]
        try:
            self.vocab = Vocabulary.from_tokens(pieces, spec.path)
        except DataError as exc:
            raise DataError(
                f"{exc}; train one with hetfair-preprocess --tokenizer sentencepiece, which defines them as control symbols"
            ) from exc

    def encode_batch(self, lines: Sequence[str]) -> list[list[int]]:
        return self._processor.encode(list(lines))

    def decode(self, ids: Sequence[int]) -> str:
        return self._processor.decode(list(ids))


def read_vocab_file(path: str) -> list[str]:
    """Tokens of a WordPiece ``vocab.txt`` (one token per line), checked for shape."""
    if not os.path.isfile(path):
        raise DataError(f"vocabulary file {path} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            tokens = [line.rstrip("\r\n") for line in f]
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not a vocabulary: not UTF-8 text (byte {exc.start})") from exc
    seen: dict[str, int] = {}
    for number, token in enumerate(tokens, start=1):
        if not token or token != token.strip() or len(token.split()) != 1:
            raise DataError(f"{path} is not a vocabulary: line {number} is not a single token: {token[:40]!r}")
        if token in seen:
            raise DataError(f"{path} is not a vocabulary: token {token!r} on lines {seen[token]} and {number}")
        seen[token] = number
    if not tokens:
        raise DataError(f"vocabulary file {path} is empty")
    return tokens


def spec_for_file(path: str, lowercase: bool) -> TokenizerSpec:
    """Spec of a vocabulary file: ``*.model`` is sentencepiece, anything else a WordPiece ``vocab.txt``."""
    return TokenizerSpec("sentencepiece" if path.endswith(".model") else "wordpiece", path, lowercase)


def load_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    """Build the tokenizer described by ``spec``."""
    if spec.kind == "wordpiece":
        return WordPieceTokenizer(spec)
    if spec.kind == "sentencepiece":
        return SentencePieceTokenizer(spec)
    raise ConfigError(f"unknown tokenizer '{spec.kind}'; choose one of: {', '.join(TOKENIZER_KINDS)}")


def check_same_vocabulary(given: Tokenizer, existing: Tokenizer) -> None:
    """Raise :class:`ConfigError` unless the two tokenizers produce the same ids."""
    a, b = given.spec, existing.spec
    if a.kind != b.kind:
        raise ConfigError(f"vocabulary {a.path} is {a.kind} but {b.path} is {b.kind}")
    if a.kind == "wordpiece" and a.lowercase != b.lowercase:
        raise ConfigError(f"{b.path} was used with lowercase={b.lowercase}, not lowercase={a.lowercase}")
    ours, theirs = given.vocab.tokens, existing.vocab.tokens
    if ours != theirs:
        first = next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), min(len(ours), len(theirs)))
        raise ConfigError(
            f"vocabulary {a.path} ({len(ours)} tokens) differs from {b.path} ({len(theirs)} tokens) "
            f"at id {first}; use the vocabulary the data was made with, or a fresh directory"
        )


def train_tokenizer(kind: str, text: Callable[[], Iterable[str]], vocab_size: int, lowercase: bool, out_dir: str,
                    character_coverage: float = 0.9995) -> TokenizerSpec:
    """Train a ``kind`` vocabulary of ``vocab_size`` tokens on the lines ``text()`` yields; save it into ``out_dir``.

    ``text`` gives the training text afresh at each call (WordPiece reads it twice, see
    :func:`_continuing_subwords`). ``character_coverage`` (sentencepiece only): share of
    characters the vocabulary must cover; rarer characters become ``[UNK]``.
    """
    path = os.path.join(out_dir, VOCAB_FILE_NAMES[kind])
    if kind == "wordpiece":
        trainer = BertWordPieceTokenizer(lowercase=lowercase)
        pinned = _continuing_subwords(trainer, text(), _WORDPIECE_ALPHABET_LIMIT)
        trainer.train_from_iterator(iter(text()), vocab_size=vocab_size, special_tokens=[*SPECIAL_TOKENS, *pinned],
                                    limit_alphabet=_WORDPIECE_ALPHABET_LIMIT, show_progress=False)
        trainer.save_model(out_dir)
        return TokenizerSpec(kind, path, lowercase)
    _train_sentencepiece(iter(text()), vocab_size, lowercase, character_coverage, path)
    return TokenizerSpec(kind, path, lowercase)


_WORDPIECE_ALPHABET_LIMIT = 1000  # the tokenizers library's default for BertWordPieceTokenizer


def _continuing_subwords(trainer: BertWordPieceTokenizer, lines: Iterable[str], alphabet_limit: int) -> list[str]:
    """The ``##c`` tokens that training will create, in a fixed order, to be given to the trainer up front.

    The ``tokenizers`` trainer (0.23) numbers these tokens in the iteration order of a hash map
    with a random seed per process, and breaks ties between equally frequent merges by those
    numbers: the same text gave different vocabularies from run to run (huggingface/tokenizers
    #1794). Tokens the trainer already knows keep their place, so naming them all first makes
    training deterministic. They are every character seen after a word's first one among the
    characters frequent enough for the trainer's alphabet (a superset where counts tie at its limit).
    """
    normalizer, pre_tokenizer = trainer.normalizer, trainer.pre_tokenizer
    counts: Counter[str] = Counter()
    continuing: set[str] = set()
    for line in lines:
        for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(line)):
            counts.update(word)
            continuing.update(word[1:])
    ranked = sorted(counts.values(), reverse=True)
    least = ranked[alphabet_limit - 1] if len(ranked) > alphabet_limit else 0
    return [f"##{char}" for char in sorted(continuing) if counts[char] >= least]


def _train_sentencepiece(lines: Iterator[str], vocab_size: int, lowercase: bool, character_coverage: float,
                         path: str) -> None:
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=lines,
            model_writer=model,
            vocab_size=vocab_size,
            # BERT's special tokens as sentencepiece's own pad/unk/bos/eos pieces plus a
            # control symbol: encoding text never produces them, even "[MASK]" written out.
            pad_id=0, pad_piece=PAD, unk_id=1, unk_piece=UNK,
            bos_id=2, bos_piece=CLS, eos_id=3, eos_piece=SEP,
            control_symbols=[MASK],
            normalization_rule_name="nmt_nfkc_cf" if lowercase else "nmt_nfkc",
            character_coverage=character_coverage,
            input_sentence_size=10_000_000,
            shuffle_input_sentence=True,
            max_sentence_length=16384,
            minloglevel=2,
        )
    except RuntimeError as exc:
        raise ConfigError(f"cannot train a sentencepiece vocabulary: {str(exc).split('] ')[-1]}") from exc
    with open(path, "wb") as f:
        f.write(model.getvalue())

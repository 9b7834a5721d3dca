"""Hugging Face tokenizer files for a hetfair BERT vocabulary: the ids training used, in ``transformers``.

A WordPiece vocabulary becomes ``vocab.txt`` for ``BertTokenizer`` (same normaliser as
training's ``tokenizers`` WordPiece). A sentencepiece model becomes a ``tokenizer.json``
(``tokenizers``) that ``AutoTokenizer`` loads as a ``PreTrainedTokenizerFast``: the model's own
normalisation rules (its precompiled character map), whitespace handling, dummy prefix and
unigram scores, so it segments text as ``sentencepiece`` does. In both, BERT's special tokens
are special tokens, so a literal "[MASK]" in the text is the mask token (sentencepiece itself
splits such text into ordinary pieces). Where two segmentations score the same, sentencepiece's
float32 sums and ``tokenizers``' float64 sums may pick different ones (4 to 17 of the Jargon
File's 29,771 lines in the tests, mostly runs of repeated characters). What a ``tokenizer.json``
cannot rebuild (BPE, char and word models, user-defined symbols, whitespace as a suffix) is
refused rather than exported wrong.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import Unigram

from hetfair.bert.tokenizer import CLS, MASK, PAD, SEP, SPECIAL_TOKENS, UNK, TokenizerSpec, Vocabulary
from hetfair.errors import ConfigError

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TOKENIZER_FILE = "tokenizer.json"
VOCAB_FILE = "vocab.txt"
MODEL_INPUT_NAMES = ["input_ids", "token_type_ids", "attention_mask"]  # what BERT's forward takes
_SPECIAL_TOKEN_NAMES = {"unk_token": UNK, "sep_token": SEP, "pad_token": PAD, "cls_token": CLS, "mask_token": MASK}
_SPACE = "\u2581"  # sentencepiece's "▁", which stands for a space inside pieces


def hf_tokenizer_files(spec: TokenizerSpec, vocab: Vocabulary, max_length: int) -> dict[str, str]:
    """File name -> text of the Hugging Face tokenizer files of ``spec``'s vocabulary.

    Raises :class:`ConfigError` for a sentencepiece model that ``tokenizers`` cannot rebuild.
    """
    config: dict[str, Any] = {"model_max_length": max_length, **_SPECIAL_TOKEN_NAMES}
    if spec.kind == "wordpiece":
        config.update(tokenizer_class="BertTokenizer", do_lower_case=spec.lowercase)
        return {VOCAB_FILE: "\n".join(vocab.tokens) + "\n", TOKENIZER_CONFIG_FILE: json.dumps(config, indent=2)}
    tokenizer = sentencepiece_tokenizer(spec.path, vocab)
    config.update(tokenizer_class="PreTrainedTokenizerFast", model_input_names=MODEL_INPUT_NAMES)
    return {TOKENIZER_FILE: tokenizer.to_str(), TOKENIZER_CONFIG_FILE: json.dumps(config, indent=2)}


def hf_vocabulary_tokens(directory: str) -> list[str] | None:
    """Tokens in id order of a Hugging Face directory's ``vocab.txt``, else of its ``tokenizer.json``; else ``None``."""
    vocab_path, tokenizer_path = os.path.join(directory, VOCAB_FILE), os.path.join(directory, TOKENIZER_FILE)
    if os.path.isfile(vocab_path):
        with open(vocab_path, encoding="utf-8") as f:
            return [line.rstrip("\r\n") for line in f]
    if os.path.isfile(tokenizer_path):
        try:
            vocab = Tokenizer.from_file(tokenizer_path).get_vocab(with_added_tokens=True)
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a plain Exception for any bad file
            raise ConfigError(f"{tokenizer_path} is not a tokenizers file: {str(exc).splitlines()[0]}") from exc
        return sorted(vocab, key=vocab.__getitem__)
    return None


def sentencepiece_tokenizer(path: str, vocab: Vocabulary) -> Tokenizer:
    """A ``tokenizers`` unigram tokenizer giving the ids of sentencepiece model ``path``, with BERT's templates."""
    proto = _read_model_proto(path)
    trainer, normalizer = proto.trainer_spec, proto.normalizer_spec
    if trainer.model_type != trainer.UNIGRAM:
        kind = trainer.ModelType.Name(trainer.model_type)
        raise ConfigError(f"{path} is a {kind} sentencepiece model; hetfair-export writes a Hugging Face tokenizer "
                          f"only for unigram models (hetfair-preprocess --tokenizer sentencepiece trains one)")
    if trainer.treat_whitespace_as_suffix:
        raise ConfigError(f"{path} treats whitespace as a suffix, which a Hugging Face tokenizer cannot rebuild; "
                          f"export a model trained without treat_whitespace_as_suffix")
    pieces = proto.pieces
    user_defined = [p.piece for p in pieces if p.type == p.USER_DEFINED]
    if user_defined:  # sentencepiece gives them a length bonus in its lattice that a tokenizer.json cannot hold
        raise ConfigError(f"{path} has user-defined symbols ({' '.join(user_defined[:5])}), which a Hugging Face "
                          f"tokenizer does not segment as sentencepiece does; export a model trained without them")
    tokenizer = Tokenizer(Unigram([(p.piece, p.score) for p in pieces], unk_id=trainer.unk_id,
                                  byte_fallback=trainer.byte_fallback))
    tokenizer.normalizer = normalizers.Sequence(_normalizers(normalizer))
    if normalizer.add_dummy_prefix:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE, prepend_scheme="always", split=False)
    tokenizer.decoder = decoders.Sequence(_decoders(normalizer.add_dummy_prefix, trainer.byte_fallback))
    specials = [p.piece for p in pieces if p.type in (p.CONTROL, p.UNKNOWN) or p.piece in SPECIAL_TOKENS]
    tokenizer.add_special_tokens([AddedToken(piece, normalized=False, special=True) for piece in specials])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{CLS} $A {SEP}", pair=f"{CLS} $A {SEP} $B:1 {SEP}:1",
        special_tokens=[(CLS, vocab.cls), (SEP, vocab.sep)])
    return tokenizer


def _read_model_proto(path: str) -> Any:
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:  # the generated module needs protobuf
        raise ConfigError("exporting a sentencepiece vocabulary needs protobuf: pip install 'hetfair[hf]'") from None
    with open(path, "rb") as f:
        return sentencepiece_model_pb2.ModelProto.FromString(f.read())


def _normalizers(spec: Any) -> list[normalizers.Normalizer]:
    """sentencepiece's normalisation, in its order: character map, extra spaces, escaped spaces."""
    steps: list[normalizers.Normalizer] = []
    if spec.precompiled_charsmap:
        steps.append(normalizers.Precompiled(spec.precompiled_charsmap))
    if spec.remove_extra_whitespaces:  # only spaces: sentencepiece leaves other whitespace alone
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if spec.escape_whitespaces:
        steps.append(normalizers.Replace(" ", _SPACE))
    if spec.add_dummy_prefix:  # Metaspace adds no prefix to a text starting with "▁"; sentencepiece does
        steps.append(normalizers.Replace(Regex(rf"\A{_SPACE}"), _SPACE * 2))
    return steps


def _decoders(add_dummy_prefix: bool, byte_fallback: bool) -> list[decoders.Decoder]:
    steps: list[decoders.Decoder] = [decoders.Replace(_SPACE, " ")]
    if byte_fallback:
        steps.append(decoders.ByteFallback())
    steps.append(decoders.Fuse())
    if add_dummy_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    return steps

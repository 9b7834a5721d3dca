"""Tiny corpora, vocabularies and preprocessed directories for the BERT tests.

Reference vocabularies are made with the ``tokenizers`` / ``sentencepiece``
libraries directly, so tests compare hetfair's output against the libraries,
not against hetfair itself.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import sentencepiece as spm
from tokenizers import BertWordPieceTokenizer

from hetfair_cli.preprocess import main as preprocess_main

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = (
    "the a hacker wrote code for machines and networks while users read manuals about systems "
    "kernel compiler program loops data bits bytes memory disk terminal café naïve résumé "
    "Alice Bob Carol quickly slowly never always because although running jumped eaten "
    "heterogeneous clusters GPUs train models gradient descent tokens sentences documents"
).split()
PUNCTUATION = [".", ".", ".", "!", "?", ",", ";"]

TINY_CONFIG = {
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
    "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
    "max_position_embeddings": 128, "type_vocab_size": 2,
}


def sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(3, 14))]
    words[0] = words[0].capitalize()
    if rng.random() < 0.3:
        words.insert(rng.randint(1, len(words) - 1), rng.choice(PUNCTUATION[3:]))
    return " ".join(words) + rng.choice(PUNCTUATION[:4])


def documents(n_docs: int, seed: int = 0, max_sentences: int = 8) -> list[list[str]]:
    rng = random.Random(seed)
    return [[sentence(rng) for _ in range(rng.randint(1, max_sentences))] for _ in range(n_docs)]


def write_corpus(path: Path, docs: list[list[str]]) -> Path:
    """One sentence per line, a blank line between documents (sometimes two, and stray spaces)."""
    with open(path, "w", encoding="utf-8") as f:
        for i, doc in enumerate(docs):
            f.write("\n".join(doc) + "\n")
            f.write("\n" if i % 3 else "  \n\n")
    return path


def corpus_lines(docs: list[list[str]]) -> list[str]:
    return [line for doc in docs for line in doc]


def reference_wordpiece(lines: list[str], vocab_size: int, path: Path, lowercase: bool = True) -> Path:
    """A BERT vocab.txt trained with the tokenizers library itself."""
    tokenizer = BertWordPieceTokenizer(lowercase=lowercase)
    tokenizer.train_from_iterator(lines, vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    path.write_text("".join(token + "\n" for token, _ in vocab), encoding="utf-8")
    return path


def reference_sentencepiece(lines: list[str], vocab_size: int, path: Path, with_specials: bool = True) -> Path:
    """A sentencepiece model trained with the sentencepiece library itself."""
    model = io.BytesIO()
    bert_specials = {"pad_id": 0, "pad_piece": "[PAD]", "unk_id": 1, "unk_piece": "[UNK]", "bos_id": 2,
                     "bos_piece": "[CLS]", "eos_id": 3, "eos_piece": "[SEP]", "control_symbols": ["[MASK]"]}
    specials = bert_specials if with_specials else {}
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
                                   character_coverage=1.0, minloglevel=2, **specials)
    path.write_bytes(model.getvalue())
    return path


def make_data_dir(tmp_path: Path, n_docs: int = 60, seed: int = 0, vocab_size: int = 300,
                  splits: tuple[str, ...] = ("train", "valid", "test")) -> tuple[Path, Path, list[list[str]]]:
    """A preprocessed directory (WordPiece) with the given splits; returns (dir, vocab.txt, train docs)."""
    flags = {"train": "--trainpref", "valid": "--validpref", "test": "--testpref"}
    all_docs = {split: documents(n_docs if split == "train" else max(n_docs // 4, 4), seed=seed + i)
                for i, split in enumerate(splits)}
    vocab = reference_wordpiece(corpus_lines(all_docs[splits[0]]), vocab_size, tmp_path / "vocab.txt")
    args = ["--destdir", str(tmp_path / "data"), "--dict", str(vocab)]
    for split in splits:
        args += [flags[split], str(write_corpus(tmp_path / f"{split}.txt", all_docs[split]))]
    assert preprocess_main(args) == 0
    return tmp_path / "data", vocab, all_docs[splits[0]]


def write_bert_config(path: Path, **overrides: object) -> Path:
    path.write_text(json.dumps({**TINY_CONFIG, **overrides}))
    return path

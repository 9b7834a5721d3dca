"""A tiny preprocessed language-modelling corpus and tiny transformer_lm runs, for the model-side tests."""

from __future__ import annotations

from pathlib import Path

from bert_helpers import documents
from hetfair_cli.train import main as train_main
from lm_helpers import preprocess, write_text

TOKENS_PER_SAMPLE = 16
TINY = ("--decoder-embed-dim", "32", "--decoder-layers", "2", "--decoder-attention-heads", "4",
        "--decoder-ffn-embed-dim", "64", "--tokens-per-sample", str(TOKENS_PER_SAMPLE))
NO_DROPOUT = ("--dropout", "0", "--attention-dropout", "0")


def make_lm_data(tmp: Path, vocab_size: int = 300) -> Path:
    """``hetfair-preprocess --task language_modeling`` output (a trained byte-level BPE) of 60 made-up documents."""
    docs = ["\n".join(doc) for doc in documents(60, seed=3)]
    return preprocess(tmp / "data", "--trainpref", str(write_text(tmp / "train.txt", docs[:50])),
                      "--validpref", str(write_text(tmp / "valid.txt", docs[50:])), "--tokenizer", "bpe",
                      "--vocab-size", str(vocab_size))


def lm_train_args(data: Path, save_dir: Path, *extra: str) -> list[str]:
    """A tiny model for 2 updates of 8 blocks, without dropout."""
    return ["--task", "language_modeling", "--data", str(data), "--arch", "gpt_tiny", *TINY, *NO_DROPOUT,
            "--max-tokens", str(8 * TOKENS_PER_SAMPLE), "--max-update", "2", "--save-dir", str(save_dir),
            "--log-format", "none", "--disable-validation", "--no-epoch-checkpoints", *extra]


def train_tiny_lm(data: Path, save_dir: Path, *extra: str) -> Path:
    assert train_main(lm_train_args(data, save_dir, *extra)) == 0
    return save_dir / "checkpoint_last.pt"

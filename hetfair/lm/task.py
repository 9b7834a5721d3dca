"""The ``language_modeling`` task: next-token prediction on a ``hetfair-preprocess --task language_modeling`` output.

``--data DIR`` holds ``tokenizer.json`` and ``SPLIT.bin``/``SPLIT.idx`` per split (see
:mod:`hetfair.lm.preprocess`); samples are blocks of ``--tokens-per-sample`` tokens of each
split's stream (:class:`~hetfair.lm.dataset.TokenBlockDataset`), so ``--max-tokens N`` gives
``N // tokens_per_sample`` blocks per micro-batch.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, ClassVar

from tokenizers import Tokenizer

from hetfair.data.indexed_dataset import IndexedDataset, dataset_exists
from hetfair.data.preprocess_output import SPLIT_FLAGS
from hetfair.errors import ConfigError, DataError
from hetfair.lm.dataset import TokenBlockDataset, collate_blocks
from hetfair.lm.tokenizer import EOS_TOKEN, PAD_TOKEN, TOKENIZER_FILE, load_tokenizer, special_id
from hetfair.tasks import register_task
from hetfair.tasks.task import Task
from hetfair.utils import absolute_path

"""Split name -> the hetfair-preprocess flag (without "--") that creates it."""


@register_task("language_modeling")
class LanguageModelingTask(Task):
    """Causal language modelling on packed blocks of a tokenized corpus.

    Defaults follow GPT-2 training: the ``transformer_lm`` model's ``gpt_mini``, AdamW with a
    polynomial (linear) decay after warm-up.
    """

    option_defaults: ClassVar[dict[str, Any]] = {
        "criterion": "lm_cross_entropy",
        "arch": "gpt_mini",
        "optimizer": "adamw",
        "lr_scheduler": "polynomial_decay",
    }

    def __init__(self, args: argparse.Namespace, tokenizer: Tokenizer, tokenizer_file: Path) -> None:
        super().__init__(args)
        self.tokenizer = tokenizer
        self.tokenizer_file = tokenizer_file
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_index = special_id(tokenizer, EOS_TOKEN)
        self.pad_index = special_id(tokenizer, PAD_TOKEN)

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--tokens-per-sample", type=int, default=512, metavar="N",
                            help="tokens per block (the model's context); blocks pack contiguous text across documents")

    @classmethod
    def setup_task(cls, args: argparse.Namespace) -> "LanguageModelingTask":
        if not args.data:
            raise ConfigError("the language_modeling task needs --data DIR, a directory made by "
                              "hetfair-preprocess --task language_modeling")
        data = Path(absolute_path(args.data))
        if not data.is_dir():
            raise DataError(f"--data {args.data}: no such directory" if not data.exists() else
                            f"--data {args.data} is a file, not a directory; give the --destdir of "
                            f"hetfair-preprocess --task language_modeling")
        if args.tokens_per_sample < 1:
            raise ConfigError(f"--tokens-per-sample must be at least 1, got {args.tokens_per_sample}")
        tokenizer_file = data / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise DataError(f"--data {args.data} has no {TOKENIZER_FILE}; make the directory with "
                            f"hetfair-preprocess --task language_modeling")
        return cls(args, load_tokenizer(tokenizer_file), tokenizer_file)

    def load_dataset(self, split: str) -> TokenBlockDataset:
        prefix = str(Path(absolute_path(self.args.data)) / split)
        if not dataset_exists(prefix):
            flag = f"--{SPLIT_FLAGS[split]}" if split in SPLIT_FLAGS else "--trainpref/--validpref/--testpref"
            raise DataError(f"no split '{split}' in {self.args.data} ({prefix}.bin/.idx); create it with "
                            f"hetfair-preprocess --task language_modeling {flag}")
        data = IndexedDataset(prefix)
        blocks = TokenBlockDataset(data, self.args.tokens_per_sample)
        if split == self.args.train_subset:
            self._check_fits_training_split(data, prefix)
        return blocks

    def _check_fits_training_split(self, data: IndexedDataset, prefix: str) -> None:
        """Refuse samples longer than the training split: there would be one, mostly padding, every update."""
        inputs = data.num_tokens - 1  # every token but the last is an input
        if self.args.tokens_per_sample > inputs:
            raise ConfigError(f"--tokens-per-sample {self.args.tokens_per_sample} is longer than the training split "
                              f"{prefix} ({data.num_tokens} tokens, {inputs} of them inputs): it would train on one "
                              f"padded sample; give --tokens-per-sample {inputs} or less")

    def collater(self, samples: list[Any]) -> dict[str, Any]:
        return collate_blocks(samples, self.pad_index)

    def max_positions(self) -> int:
        return self.args.tokens_per_sample

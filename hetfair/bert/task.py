"""The ``bert`` task: masked-LM (and optional next-sentence) pretraining.

``--data`` is either a ``hetfair-preprocess`` output (dynamic masks) or a directory of
HetSeq's / NVIDIA's ``*.hdf5`` shards (static masks, see :mod:`hetfair.bert.hdf5_dataset`).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, ClassVar

from hetfair.bert.data_dir import destdir_tokenizer_spec, read_metadata
from hetfair.bert.dataset import BertDataset, collate_bert
from hetfair.bert.hdf5_dataset import Hdf5BertDataset, Hdf5Shard, hdf5_shards, split_shards
from hetfair.data.indexed_dataset import IndexedDataset, dataset_exists
from hetfair.data.preprocess_output import SPLIT_FLAGS
from hetfair.bert.masking import MaskingConfig
from hetfair.bert.tokenizer import (
    Tokenizer,
    check_same_vocabulary,
    load_tokenizer,
    spec_for_file,
)
from hetfair.errors import ConfigError, DataError
from hetfair.tasks import register_task
from hetfair.tasks.task import Task
from hetfair.utils import absolute_path


@register_task("bert")
class BertTask(Task):
    """BERT pretraining on a ``hetfair-preprocess`` output directory or on ``*.hdf5`` shards.

    Defaults follow BERT: AdamW with a polynomial (linear) decay after warm-up,
    so HetSeq's ``--lr --warmup-updates --total-num-update --weight-decay``
    command means what it meant there.
    """

    option_defaults: ClassVar[dict[str, Any]] = {
        "criterion": "masked_lm",
        "arch": "bert_base",
        "optimizer": "adamw",
        "lr_scheduler": "polynomial_decay",
    }

    def __init__(self, args: argparse.Namespace, tokenizer: Tokenizer, hdf5_length: int | None = None) -> None:
        super().__init__(args)
        self.vocab = tokenizer.vocab
        self.tokenizer_spec = tokenizer.spec  # the vocabulary's file and normalisation, for exporting it
        self.hdf5_length = hdf5_length  # sequence length of the .hdf5 shards (None: hetfair-preprocess data)
        if args.nsp is None:  # NVIDIA's shards carry next-sentence labels, and HetSeq trained on them
            args.nsp = hdf5_length is not None
        self.masking = MaskingConfig(args.mask_prob, args.random_token_prob, args.leave_unmasked_prob)

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--dict", metavar="VOCAB", type=absolute_path,
                            help="vocabulary (vocab.txt or sentencepiece .model); must match the one in --data "
                                 "(required for .hdf5 shards)")
        parser.add_argument("--tokens-per-sample", type=int, default=128, metavar="N",
                            help="longest sample in tokens, [CLS]/[SEP] included")
        parser.add_argument("--nsp", action=argparse.BooleanOptionalAction, default=None,
                            help="next-sentence prediction: samples are [CLS] A [SEP] B [SEP] sentence pairs "
                                 "(default: on for .hdf5 shards, off for hetfair-preprocess data)")
        parser.add_argument("--mask-prob", type=float, default=0.15, metavar="P", help="share of tokens to predict")
        parser.add_argument("--random-token-prob", type=float, default=0.1, metavar="P",
                            help="share of predicted tokens replaced by a random token")
        parser.add_argument("--leave-unmasked-prob", type=float, default=0.1, metavar="P",
                            help="share of predicted tokens left unchanged")

    @classmethod
    def setup_task(cls, args: argparse.Namespace) -> "BertTask":
        if not args.data:
            raise ConfigError("the bert task needs --data DIR, a directory made by hetfair-preprocess "
                              "or holding .hdf5 shards")
        if os.path.exists(args.data) and not os.path.isdir(args.data):
            raise DataError(f"--data {args.data} is a file, not a directory; give the directory that "
                            f"hetfair-preprocess wrote (its --destdir)")
        if not os.path.isdir(args.data):
            raise DataError(f"--data {args.data}: no such directory")
        if read_metadata(args.data) is None and hdf5_shards(args.data):
            if not args.dict:
                raise ConfigError(f"--data {args.data} holds .hdf5 shards: give their vocabulary with --dict vocab.txt")
            length = max(Hdf5Shard(path).seq_length for path in hdf5_shards(args.data))
            return cls(args, load_tokenizer(spec_for_file(args.dict, lowercase=True)), hdf5_length=length)
        tokenizer = load_tokenizer(destdir_tokenizer_spec(args.data))
        if args.dict:
            given = load_tokenizer(spec_for_file(args.dict, tokenizer.spec.lowercase))
            check_same_vocabulary(given, tokenizer)
        return cls(args, tokenizer)

    def load_dataset(self, split: str) -> BertDataset | Hdf5BertDataset:
        if self.hdf5_length is not None:
            return self._load_hdf5(split)
        prefix = os.path.join(self.args.data, split)
        if not dataset_exists(prefix):
            flag = f"--{SPLIT_FLAGS[split]}" if split in SPLIT_FLAGS else "--trainpref/--validpref/--testpref"
            raise DataError(f"no split '{split}' in {self.args.data} ({prefix}.bin/.idx); "
                            f"create it with hetfair-preprocess {flag}")
        return BertDataset(IndexedDataset(prefix), self.vocab, self.args.tokens_per_sample, self.masking,
                           self.args.seed, self.args.nsp)

    def _load_hdf5(self, split: str) -> Hdf5BertDataset:
        shards = split_shards(self.args.data, split)
        if not shards:
            raise DataError(f"no .hdf5 shard of split '{split}' in {self.args.data} (file names must contain "
                            f"'{split}'); choose another --train-subset/--valid-subset")
        return Hdf5BertDataset(shards, with_nsp=self.args.nsp)

    def begin_epoch(self, epoch: int) -> None:
        """Redraw the training masks; validation splits keep epoch 1's so their losses compare across epochs."""
        self.dataset(self.args.train_subset).set_epoch(epoch)

    def collater(self, samples: list[Any]) -> dict[str, Any]:
        return collate_bert(samples, self.vocab.pad)

    def max_positions(self) -> int:
        return self.hdf5_length if self.hdf5_length is not None else self.args.tokens_per_sample

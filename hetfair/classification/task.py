"""The ``sentence_classification`` task: fine-tune an encoder on labelled sentences or sentence pairs.

Data: ``--data DIR`` holding ``train.csv`` (or ``.tsv``, ``.jsonl``) and ``valid.*``, or
``--train-file`` / ``--valid-file``; one text column (``--text-column``), optionally a second
one for sentence pairs (``--text-pair-column``), and a label column (``--label-column``). Text is
tokenized with the model's own tokenizer (see :mod:`hetfair.classification.tokenizer_source`)
and each batch is padded to its longest sentence.

The resolved tokenizer, casing, longest input and class names are written back into the
options, so a checkpoint records them and ``hetfair-validate`` / ``hetfair-export`` rebuild the
task the run trained with.
"""

from __future__ import annotations

import argparse
from typing import Any, ClassVar, Optional

from hetfair.classification.dataset import LabelledSentences, collate_sentences
from hetfair.classification.labelled_text import Columns, LabelledText, class_indices, label_names_of, \
    read_labelled_text, split_file
from hetfair.classification.tokenization import TextEncoder, load_text_encoder
from hetfair.classification.tokenizer_source import resolve_tokenizer
from hetfair.errors import ConfigError
from hetfair.tasks import register_task
from hetfair.tasks.task import Task
from hetfair.utils import absolute_path


def _class_list(text: str) -> list[str]:
    return [name.strip() for name in text.split(",")]


@register_task("sentence_classification")
class SentenceClassificationTask(Task):
    """Sentence (pair) classification with ``--num-classes`` classes; see the module docstring.

    Exposes ``num_classes``, ``label_names`` (class names in class-index order), ``pad_index``,
    ``vocab_size`` and ``encoder`` (the :class:`TextEncoder`, whose ``hf_files`` an export writes).
    """

    option_defaults: ClassVar[dict[str, Any]] = {
        "criterion": "sentence_classification",
        "arch": "bert_classifier",
        "optimizer": "adamw",
        "lr_scheduler": "polynomial_decay",
    }

    def __init__(self, args: argparse.Namespace, encoder: TextEncoder) -> None:
        super().__init__(args)
        self.encoder = encoder
        self.num_classes: int = args.num_classes
        self.label_names: list[str] = list(args.label_names or [])
        self.pad_index = encoder.pad_index
        self.vocab_size = encoder.vocab_size
        self.columns = Columns(args.text_column, args.text_pair_column, args.label_column)
        self._files: dict[str, LabelledText] = {}

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--num-classes", type=int, metavar="K", help="number of classes (required)")
        parser.add_argument("--train-file", type=absolute_path, metavar="FILE",
                            help="training file (.csv, .tsv, .jsonl); default: train.* in --data")
        parser.add_argument("--valid-file", type=absolute_path, metavar="FILE",
                            help="validation file (.csv, .tsv, .jsonl); default: valid.* in --data")
        parser.add_argument("--text-column", default="text", metavar="NAME", help="column of the sentence")
        parser.add_argument("--text-pair-column", metavar="NAME",
                            help="column of the second sentence, for sentence-pair tasks (default: single sentences)")
        parser.add_argument("--label-column", default="label", metavar="NAME", help="column of the label")
        parser.add_argument("--label-names", type=_class_list, metavar="A,B,...",
                            help="the classes in class-index order (default: labels 0..K-1 are their own index, "
                                 "other labels are sorted)")
        parser.add_argument("--tokenizer", type=absolute_path, metavar="PATH",
                            help="the model's tokenizer: tokenizer.json, vocab.txt, or a folder holding one "
                                 "(default: --hf-model's or --init-from-hf's folder, or the pretraining data's "
                                 "vocabulary of --init-from-checkpoint)")
        parser.add_argument("--lowercase", action=argparse.BooleanOptionalAction, default=None,
                            help="lowercase text for a vocab.txt (default: its tokenizer_config.json's "
                                 "do_lower_case, else the pretraining data's setting, else on)")
        parser.add_argument("--max-positions", type=int, metavar="N",
                            help="longest input in tokens, special tokens included; longer ones are truncated "
                                 "(default: the tokenizer's model_max_length, else the model's "
                                 "max_position_embeddings)")

    @classmethod
    def setup_task(cls, args: argparse.Namespace) -> "SentenceClassificationTask":
        if args.num_classes is None or args.num_classes < 2:
            raise ConfigError(f"the sentence_classification task needs --num-classes K with K >= 2, got "
                              f"{args.num_classes}")
        if args.max_positions is not None and args.max_positions < 2:
            raise ConfigError(f"--max-positions must be at least 2 ([CLS] and [SEP]), got {args.max_positions}")
        if args.label_names and len(args.label_names) != args.num_classes:
            raise ConfigError(f"--label-names lists {len(args.label_names)} classes but --num-classes is "
                              f"{args.num_classes}")
        source = resolve_tokenizer(args)
        encoder = load_text_encoder(source.path, source.lowercase, source.max_positions)
        vars(args).update(tokenizer=source.path, lowercase=source.lowercase, max_positions=source.max_positions)
        task = cls(args, encoder)
        if not args.label_names:
            args.label_names = label_names_of(task.labelled_text(args.train_subset), args.num_classes)
            task.label_names = list(args.label_names)
        return task

    def split_path(self, split: str) -> str:
        """The file of ``split``: ``--train-file`` / ``--valid-file``, else ``split.*`` in ``--data``."""
        given: Optional[str] = getattr(self.args, f"{split}_file", None)
        return given or split_file(self.args.data, split)

    def labelled_text(self, split: str) -> LabelledText:
        """The rows of ``split``'s file, read once."""
        if split not in self._files:
            self._files[split] = read_labelled_text(self.split_path(split), self.columns)
        return self._files[split]

    def load_dataset(self, split: str) -> LabelledSentences:
        data = self.labelled_text(split)
        targets = class_indices(data, self.label_names)
        dataset = LabelledSentences(self.encoder.encode(data.texts, data.pairs), targets)
        self._files.pop(split)  # the tokenized dataset is what stays
        return dataset

    def collater(self, samples: list[Any]) -> dict[str, Any]:
        return collate_sentences(samples, self.pad_index)

    def max_positions(self) -> int:
        return self.encoder.max_length

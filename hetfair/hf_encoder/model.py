"""``--arch hf_encoder --hf-model DIR``: a ``transformers`` encoder with its own sequence-classification head.

``AutoModelForSequenceClassification.from_pretrained(DIR, num_labels=task.num_classes)`` from local
files only: BERT, RoBERTa, DistilBERT, MiniLM ... whatever ``transformers`` loads from a folder. A
folder holding only the encoder (a bare ``BertModel``) gets the head transformers initialises (from
hetfair's seed, so every rank starts equal), as does a folder whose head has another number of
classes. The weights are fp32 whatever the folder stores (``--precision`` casts per operation).
Checkpoints hold this model's state dict, the head included; loading one (:func:`hetfair.load_model`)
builds the model from ``DIR``'s config alone, without reading its weights, then takes the checkpoint's:
transformers' load report (a head "MISSING, newly initialized") would speak of weights that are replaced,
while a weight the checkpoint lacks is still one error.

``transformers`` is optional (the ``hf`` extra): it is imported when the model is built, and its
absence is one error line.
"""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hetfair.errors import ConfigError
from hetfair.hf_encoder.units import layer_units
from hetfair.models import register_model
from hetfair.models.model import WEIGHTS_FROM_CHECKPOINT, HetfairModel
from hetfair.utils import absolute_path

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from hetfair.tasks import Task

NET_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


@register_model("hf_encoder")
class HfEncoderModel(HetfairModel):
    """A ``transformers`` ``*ForSequenceClassification`` model: ``forward(**net_input) -> logits [B, classes]``."""

    def __init__(self, hf_model: "PreTrainedModel", source: str) -> None:
        super().__init__()
        self.hf_model = hf_model
        self.source = source
        accepted = inspect.signature(hf_model.forward).parameters
        self.inputs = tuple(name for name in NET_INPUTS if name in accepted)

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--hf-model", metavar="DIR", type=absolute_path,
                            help="local Hugging Face model folder (config.json + weights, and its tokenizer) that "
                                 "transformers' AutoModelForSequenceClassification loads; needs the hf extra")
        parser.add_argument("--hf-dropout", metavar="P", type=float,
                            help="set every dropout probability of the folder's config.json (each float field "
                                 "whose name contains 'dropout') to P, e.g. 0 (default: the config's own values)")

    @classmethod
    def build_model(cls, args: argparse.Namespace, task: "Task") -> "HfEncoderModel":
        directory = getattr(args, "hf_model", None)
        if not directory:
            raise ConfigError("--arch hf_encoder needs --hf-model DIR: a local Hugging Face model folder")
        transformers = import_transformers()
        config = _load_config(transformers, directory, task, args.hf_dropout)
        auto = transformers.AutoModelForSequenceClassification
        if getattr(args, WEIGHTS_FROM_CHECKPOINT, False):  # the folder's weights would be replaced unread
            return cls(auto.from_config(config).float(), directory)
        try:
            hf_model = auto.from_pretrained(directory, config=config, local_files_only=True,
                                            ignore_mismatched_sizes=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--hf-model {directory}: transformers cannot load its weights: "
                              f"{_first_line(exc)}") from exc
        return cls(hf_model.float(), directory)  # fp32 weights: --precision casts per op

    def sharding_units(self) -> list[nn.Module]:
        """The blocks of the model's own layer list (see :mod:`hetfair.hf_encoder.units`)."""
        return layer_units(self.hf_model)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Class scores ``[B, num_classes]``; inputs the model's ``forward`` does not take (DistilBERT's
        ``token_type_ids``) are left out."""
        given = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
        return self.hf_model(**{name: given[name] for name in self.inputs if given[name] is not None}).logits

    def export_hf(self, outdir: str, task: "Task") -> str:
        """The model's ``save_pretrained`` (labels named as the task's) and the tokenizer it was trained with.

        That tokenizer is the task's (``task.encoder.hf_files``: the files that give its ids), or for a
        task without one the ``--hf-model`` folder's ``AutoTokenizer``.
        """
        tokenizer_files = getattr(getattr(task, "encoder", None), "hf_files", None)
        tokenizer = None if tokenizer_files else self._tokenizer()  # may refuse: write after
        names = [str(name) for name in getattr(task, "label_names", range(self.hf_model.config.num_labels))]
        self.hf_model.config.id2label = dict(enumerate(names))
        self.hf_model.config.label2id = {name: index for index, name in enumerate(names)}
        self.hf_model.save_pretrained(outdir)
        if tokenizer is not None:
            tokenizer.save_pretrained(outdir)
        for name, text in (tokenizer_files or {}).items():
            Path(outdir, name).write_text(text, encoding="utf-8")
        return (f"wrote {outdir}: load it with transformers' AutoModelForSequenceClassification.from_pretrained"
                f"('{outdir}') and AutoTokenizer.from_pretrained('{outdir}')")

    def _tokenizer(self) -> Any:
        try:
            return import_transformers().AutoTokenizer.from_pretrained(self.source, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--hf-model {self.source}: its tokenizer does not load with AutoTokenizer, so the "
                              f"export would not either: {_first_line(exc)}") from exc


def import_transformers() -> Any:
    """The ``transformers`` module, or a one-line :class:`ConfigError` saying how to install it."""
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError("--arch hf_encoder needs the transformers package, which is not installed: "
                          "pip install 'hetfair[hf]'") from exc
    return transformers


def _load_config(transformers: Any, directory: str, task: "Task", dropout: float | None) -> Any:
    """The folder's config with ``num_labels`` from the task and (``--hf-dropout``) every dropout set."""
    if not Path(directory).is_dir():
        raise ConfigError(f"--hf-model {directory} is not a directory; pass a local Hugging Face model folder")
    num_classes = getattr(task, "num_classes", None)
    if num_classes is None:
        raise ConfigError(f"--arch hf_encoder classifies sentences, but --task {task.args.task} defines no "
                          f"num_classes; use --task sentence_classification")
    try:
        config = transformers.AutoConfig.from_pretrained(directory, num_labels=num_classes, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--hf-model {directory}: transformers cannot read its config.json: "
                          f"{_first_line(exc)}") from exc
    if dropout is not None:
        if not 0.0 <= dropout < 1.0:
            raise ConfigError(f"--hf-dropout {dropout} is not a probability in [0, 1)")
        for name, value in config.to_dict().items():
            if "dropout" in name and isinstance(value, float):
                setattr(config, name, dropout)
    _check_positions(config, directory, task)
    return config


def _check_positions(config: Any, directory: str, task: "Task") -> None:
    longest, limit = task.max_positions(), getattr(config, "max_position_embeddings", None)
    if longest is not None and limit is not None and longest > limit:
        raise ConfigError(f"samples of {longest} tokens do not fit the {limit} positions of --hf-model {directory}; "
                          f"lower the task's maximum length")


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__

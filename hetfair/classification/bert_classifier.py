"""hetfair's BERT encoder with a sentence-classification head, as ``transformers``' BertForSequenceClassification.

The head is BERT's: the pooler (dense + tanh on the ``[CLS]`` position), dropout and a linear
classifier. The encoder starts from random weights, from a hetfair BERT pretrained with
``--task bert`` (``--init-from-checkpoint CKPT``: its masked-LM and next-sentence heads are
dropped, its pooler kept when it has one) or from a local Hugging Face BERT
(``--init-from-hf DIR``). With either, the checkpoint's or the folder's sizes build the model;
dropout and ``initializer_range`` come from the flags. ``hetfair-export --to hf`` writes a
``BertForSequenceClassification`` folder.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hetfair.bert.config import BertConfig, config_from_file
from hetfair.bert.hf import CONFIG_FILE, SAFETENSORS_FILE, from_hf_state_dict, read_hf_directory, to_hf_config, \
    to_hf_state_dict
from hetfair.bert.model import HYPER_PARAMETERS, BertEmbeddings, BertLayer, BertModel, bert_base, bert_tiny, encode
from hetfair.checkpoint.layout import load_checkpoint, model_weights
from hetfair.classification.tokenizer_source import pretraining_options
from hetfair.errors import ConfigError
from hetfair.models import register_model, register_model_architecture
from hetfair.models.model import HetfairModel
from hetfair.utils import absolute_path

if TYPE_CHECKING:
    from hetfair.tasks import Task

logger = logging.getLogger(__name__)

SHAPE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
         "max_position_embeddings", "type_vocab_size", "layer_norm_eps")
"""The hyper-parameters an initialising checkpoint or folder decides (the others come from the flags)."""
ENCODER_PREFIXES = ("embeddings.", "layers.")
POOLER = ("pooler.weight", "pooler.bias")


@register_model("bert_classifier")
class BertClassifier(HetfairModel):
    """BERT encoder + pooler + classifier; ``forward(**net_input)`` gives ``logits[B, num_classes]``."""

    init_source_options = ("init_from_checkpoint", "init_from_hf")

    def __init__(self, config: BertConfig, num_classes: int) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, num_classes)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.initializer_range)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def sharding_units(self) -> list[nn.Module]:
        """One unit per encoder layer; embeddings and the head stay in the root unit."""
        return list(self.layers)

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        BertModel.add_args(parser)
        parser.add_argument("--init-from-checkpoint", metavar="CKPT", type=absolute_path,
                            help="start the encoder (and pooler) from a hetfair BERT checkpoint trained with "
                                 "--task bert; its sizes build the model, its MLM and NSP heads are dropped")

    @classmethod
    def build_model(cls, args: argparse.Namespace, task: "Task") -> "BertClassifier":
        if getattr(args, "init_from_checkpoint", None) and getattr(args, "init_from_hf", None):
            raise ConfigError("give --init-from-checkpoint or --init-from-hf, not both")
        vocab_size, num_classes = task.vocab_size, task.num_classes  # type: ignore[attr-defined]
        config = BertConfig(vocab_size=vocab_size, **{name: getattr(args, name) for name in HYPER_PARAMETERS})
        if args.init_from_checkpoint:
            config, weights = _from_checkpoint(args.init_from_checkpoint, config, vocab_size)
        elif args.init_from_hf:
            config, weights = _from_hf(args.init_from_hf, config, vocab_size)
        else:
            weights = {}
            if args.config_file:
                config = config_from_file(args.config_file, config)
        if task.max_positions() > config.max_position_embeddings:
            raise ConfigError(f"--max-positions {task.max_positions()} exceeds the model's max_position_embeddings "
                              f"{config.max_position_embeddings}; lower --max-positions")
        vars(args).update({name: getattr(config, name) for name in HYPER_PARAMETERS})
        model = cls(config, num_classes)
        if weights:
            model.load_state_dict(weights, strict=False)
        return model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``logits[B, num_classes]`` of ``input_ids[B, T]``; ``attention_mask`` is 1 on real tokens."""
        hidden = encode(self.embeddings, self.layers, input_ids, token_type_ids, attention_mask)
        return self.classifier(self.dropout(torch.tanh(self.pooler(hidden[:, 0]))))

    def export_hf(self, outdir: str, task: "Task") -> str:
        """A ``BertForSequenceClassification`` folder with the task's tokenizer and class names."""
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise ConfigError("exporting to Hugging Face needs safetensors: pip install 'hetfair[hf]'") from None
        state = self.state_dict()
        hf_state = to_hf_state_dict(state, self.config.num_hidden_layers, nsp=False)
        hf_state.update({"bert.pooler.dense.weight": state["pooler.weight"],
                         "bert.pooler.dense.bias": state["pooler.bias"],
                         "classifier.weight": state["classifier.weight"], "classifier.bias": state["classifier.bias"]})
        labels = task.label_names  # type: ignore[attr-defined]
        config = {**to_hf_config(self.config, nsp=False, pad_token_id=task.pad_index),  # type: ignore[attr-defined]
                  "architectures": ["BertForSequenceClassification"],
                  "id2label": {str(i): name for i, name in enumerate(labels)},
                  "label2id": {name: i for i, name in enumerate(labels)},
                  "problem_type": "single_label_classification"}
        os.makedirs(outdir, exist_ok=True)
        save_file({k: v.detach().contiguous().clone() for k, v in hf_state.items()},
                  os.path.join(outdir, SAFETENSORS_FILE), metadata={"format": "pt"})
        with open(os.path.join(outdir, CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
        for name, text in task.encoder.hf_files.items():  # type: ignore[attr-defined]
            with open(os.path.join(outdir, name), "w", encoding="utf-8") as f:
                f.write(text)
        path = json.dumps(outdir)  # a Python string literal in double quotes, whatever the path holds
        code = (f"from transformers import AutoTokenizer, AutoModelForSequenceClassification; model = "
                f"AutoModelForSequenceClassification.from_pretrained({path}); "
                f"tokenizer = AutoTokenizer.from_pretrained({path})")
        return f"wrote {outdir}; load it in Python with:\npython -c {shlex.quote(code)}"


def _shaped(config: BertConfig, source: dict[str, Any], vocab_size: int, origin: str) -> BertConfig:
    """``config`` with the sizes of ``source``; its vocabulary must be the task's."""
    if source["vocab_size"] != vocab_size:
        raise ConfigError(f"{origin} has a vocabulary of {source['vocab_size']} tokens but the tokenizer has "
                          f"{vocab_size}; fine-tune with the tokenizer it was trained with (leave out --tokenizer)")
    return BertConfig(**{**vars(config), **{name: source[name] for name in SHAPE}})


def _from_checkpoint(path: str, config: BertConfig, vocab_size: int) -> tuple[BertConfig, dict[str, torch.Tensor]]:
    """Sizes and encoder (+ pooler) weights of a ``--task bert`` checkpoint; what is dropped is logged."""
    options = pretraining_options(path)
    weights = model_weights(load_checkpoint(Path(path), mmap=True))  # copied into the model as it is built
    shaped = _shaped(config, {**options, "vocab_size": weights["embeddings.word.weight"].shape[0]}, vocab_size,
                     f"--init-from-checkpoint {path}")
    kept = {k: v for k, v in weights.items() if k.startswith(ENCODER_PREFIXES) or k in POOLER}
    dropped = sorted({k.split(".")[0] for k in weights if k not in kept and k != "lm_head.weight"})
    pooler = "its pooler is kept" if POOLER[0] in kept else "the pooler starts from random weights"
    logger.info(f"init | --init-from-checkpoint {path}: encoder of {shaped.num_hidden_layers} layers, hidden "
                f"{shaped.hidden_size}; dropped: {', '.join(dropped) or 'nothing'} (pretraining heads); {pooler}; "
                f"the classifier starts from random weights")
    return shaped, kept


def _from_hf(directory: str, config: BertConfig, vocab_size: int) -> tuple[BertConfig, dict[str, torch.Tensor]]:
    """Sizes and encoder (+ pooler) weights of a local Hugging Face BERT folder."""
    source = read_hf_directory(directory)
    shaped = _shaped(config, vars(source.config), vocab_size, f"--init-from-hf {directory}")
    state, missing = from_hf_state_dict(source.weights, shaped.num_hidden_layers, nsp=True, source=directory)
    kept = {k: v for k, v in state.items() if k.startswith(ENCODER_PREFIXES) or k in POOLER}
    pooler = "the pooler starts from random weights" if "pooler.weight" in missing else "its pooler is kept"
    logger.info(f"init | --init-from-hf {directory}: a {source.architecture} of {shaped.num_hidden_layers} layers; "
                f"{pooler}; the classifier starts from random weights")
    return shaped, kept


@register_model_architecture("bert_classifier", "bert_classifier_tiny")
def bert_classifier_tiny() -> dict[str, Any]:
    return bert_tiny()


@register_model_architecture("bert_classifier", "bert_classifier_base")
def bert_classifier_base() -> dict[str, Any]:
    return bert_base()

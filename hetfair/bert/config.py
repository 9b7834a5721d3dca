"""BERT's hyper-parameters (:class:`BertConfig`, named as in ``bert_config.json``) and its activations.

Shared by the model (:mod:`hetfair.bert.model`) and the Hugging Face conversion
(:mod:`hetfair.bert.hf`), which import this module and not each other's.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Callable

import torch
import torch.nn.functional as F

from hetfair.errors import ConfigError

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


@dataclass
class BertConfig:
    """BERT hyper-parameters, named as in ``bert_config.json``."""

    vocab_size: int
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12

    def validate(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"unknown hidden_act '{self.hidden_act}'; known: {', '.join(ACTIVATIONS)}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"hidden_size {self.hidden_size} is not a multiple of "
                              f"num_attention_heads {self.num_attention_heads}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", "float") and value < 0:
                raise ConfigError(f"{f.name} must not be negative, got {value}")


def config_from_file(path: str, base: BertConfig) -> BertConfig:
    """``base`` with the values of a ``bert_config.json`` (other keys in the file are ignored)."""
    if not os.path.isfile(path):
        raise ConfigError(f"--config_file {path} does not exist")
    try:
        with open(path) as f:
            values = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--config_file {path} is not valid JSON: {exc}") from exc
    if not isinstance(values, dict):
        raise ConfigError(f"--config_file {path} must hold a JSON object")
    config = asdict(base)
    for f in fields(BertConfig):
        if f.name not in values:
            continue
        value = values[f.name]
        expected = {"int": int, "float": (int, float), "str": str}[str(f.type)]
        if isinstance(value, bool) or not isinstance(value, expected):
            raise ConfigError(f"--config_file {path}: {f.name} must be {f.type}, got {value!r}")
        config[f.name] = value
    return BertConfig(**config)

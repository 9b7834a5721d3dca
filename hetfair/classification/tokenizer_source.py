"""Which tokenizer, casing and longest input a fine-tuning run uses, when its flags do not say.

In order: ``--tokenizer PATH``; the model's own folder (``--hf-model DIR`` of the ``hf_encoder``
arch, ``--init-from-hf DIR`` of hetfair's BERT); the pretraining data's vocabulary of a hetfair
BERT checkpoint (``--init-from-checkpoint CKPT``). The longest input is ``--max-positions``, else
the tokenizer's ``model_max_length``, else the model's ``max_position_embeddings``.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from hetfair.bert.data_dir import destdir_tokenizer_spec
from hetfair.bert.tokenizer import spec_for_file
from hetfair.checkpoint.layout import load_checkpoint, stored_config
from hetfair.classification.tokenization import folder_config, model_max_length, tokenizer_file
from hetfair.errors import ConfigError

DEFAULT_MAX_POSITIONS = 512


@dataclass(frozen=True)
class TokenizerSource:
    """A tokenizer file, whether a ``vocab.txt`` lowercases, and the longest input in tokens."""

    path: str
    lowercase: bool
    max_positions: int


def model_folder(args: argparse.Namespace) -> Optional[str]:
    """The Hugging Face folder the model starts from, if any (``--hf-model`` or ``--init-from-hf``)."""
    return getattr(args, "hf_model", None) or getattr(args, "init_from_hf", None)


def resolve_tokenizer(args: argparse.Namespace) -> TokenizerSource:
    """The run's :class:`TokenizerSource` from its flags (see the module docstring)."""
    checkpoint = getattr(args, "init_from_checkpoint", None)
    pretraining = pretraining_options(checkpoint) if checkpoint else None
    if args.tokenizer:
        path, lowercase = tokenizer_file(args.tokenizer), None
    elif model_folder(args):
        path, lowercase = tokenizer_file(model_folder(args)), None
    elif pretraining is not None:
        spec = (spec_for_file(pretraining["dict"], lowercase=True) if pretraining.get("dict")
                else destdir_tokenizer_spec(pretraining["data"]))
        path, lowercase = spec.path, spec.lowercase
    else:
        raise ConfigError("the sentence_classification task needs the model's tokenizer: give --tokenizer PATH "
                          "(a tokenizer.json, a vocab.txt or a folder holding one), --hf-model DIR or "
                          "--init-from-checkpoint CKPT")
    if args.lowercase is not None:
        lowercase = args.lowercase
    elif lowercase is None:
        lowercase = bool(folder_config(path).get("do_lower_case", True))
    return TokenizerSource(path, lowercase, args.max_positions or _max_positions(args, path, pretraining))


def pretraining_options(checkpoint: str) -> dict[str, Any]:
    """The options of a hetfair BERT checkpoint (``--init-from-checkpoint``); another task's is refused."""
    options = stored_config(load_checkpoint(Path(checkpoint)))
    if options.get("task") != "bert":
        raise ConfigError(f"--init-from-checkpoint {checkpoint} was trained with --task {options.get('task')}; "
                          f"it must be a hetfair BERT trained with --task bert")
    return options


def _max_positions(args: argparse.Namespace, path: str, pretraining: Optional[dict[str, Any]]) -> int:
    tokenizer_limit = model_max_length(path)
    if tokenizer_limit is not None:
        return tokenizer_limit
    if pretraining is not None:
        return int(pretraining["max_position_embeddings"])
    folder = model_folder(args)
    config_path = os.path.join(folder, "config.json") if folder else None
    if config_path and os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            value = json.load(f).get("max_position_embeddings")
        if isinstance(value, int):
            return value
    return int(getattr(args, "max_position_embeddings", None) or DEFAULT_MAX_POSITIONS)

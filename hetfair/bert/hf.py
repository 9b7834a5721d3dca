"""Hugging Face ``transformers`` BERT <-> hetfair ``bert``: config, parameter names, files.

The layout is ``BertForPreTraining``'s: ``bert.embeddings.*``, ``bert.encoder.layer.N.*``,
``bert.pooler.dense`` and ``cls.predictions.*`` / ``cls.seq_relationship``. hetfair keeps query,
key and value in one ``qkv`` matrix (rows in that order), which is split and joined here. The
MLM decoder is tied to the word embeddings on both sides, so it is not stored. Reading needs
only torch (and ``safetensors`` for ``model.safetensors``); ``transformers`` is never imported.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Sequence

import torch

from hetfair.bert.config import ACTIVATIONS, BertConfig
from hetfair.bert.hf_tokenizer import hf_vocabulary_tokens
from hetfair.errors import CheckpointError, ConfigError

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
PYTORCH_FILE = "pytorch_model.bin"

# hetfair name -> Hugging Face name, outside the encoder layers and the fused qkv
_TOP_LEVEL = {
    "embeddings.word.weight": "bert.embeddings.word_embeddings.weight",
    "embeddings.position.weight": "bert.embeddings.position_embeddings.weight",
    "embeddings.token_type.weight": "bert.embeddings.token_type_embeddings.weight",
    "embeddings.norm.weight": "bert.embeddings.LayerNorm.weight",
    "embeddings.norm.bias": "bert.embeddings.LayerNorm.bias",
    "lm_head.transform.weight": "cls.predictions.transform.dense.weight",
    "lm_head.transform.bias": "cls.predictions.transform.dense.bias",
    "lm_head.norm.weight": "cls.predictions.transform.LayerNorm.weight",
    "lm_head.norm.bias": "cls.predictions.transform.LayerNorm.bias",
    "lm_head.bias": "cls.predictions.bias",
}
_NSP = {
    "pooler.weight": "bert.pooler.dense.weight",
    "pooler.bias": "bert.pooler.dense.bias",
    "nsp_head.weight": "cls.seq_relationship.weight",
    "nsp_head.bias": "cls.seq_relationship.bias",
}
# per encoder layer: hetfair suffix -> Hugging Face suffix (qkv handled apart)
_LAYER = {
    "attention_out": "attention.output.dense",
    "attention_norm": "attention.output.LayerNorm",
    "intermediate": "intermediate.dense",
    "output": "output.dense",
    "output_norm": "output.LayerNorm",
}
# the parts a checkpoint may lack (a BertModel has no heads): hetfair prefix -> (what it is, its Hugging Face names)
_HEADS = {"lm_head.": ("MLM head", "cls.predictions.transform.*, cls.predictions.bias"),
          "pooler.": ("pooler", "bert.pooler.dense.*"), "nsp_head.": ("next-sentence head", "cls.seq_relationship.*")}
_TIED = "lm_head.weight"  # the same tensor as embeddings.word.weight
_UNSUPPORTED = {"position_embedding_type": "absolute", "is_decoder": False, "add_cross_attention": False}


def to_hf_config(config: BertConfig, nsp: bool, pad_token_id: int) -> dict[str, Any]:
    """``config.json`` of a ``transformers`` BERT with these hyper-parameters."""
    return {
        "architectures": ["BertForPreTraining" if nsp else "BertForMaskedLM"],
        "model_type": "bert",
        **asdict(config),
        "pad_token_id": pad_token_id,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": True,
    }


def from_hf_config(values: Mapping[str, Any], source: str) -> BertConfig:
    """The :class:`BertConfig` of a Hugging Face ``config.json``; what hetfair cannot build is an error."""
    if values.get("model_type", "bert") != "bert":
        raise ConfigError(f"{source} describes a '{values.get('model_type')}' model, not BERT")
    for key, supported in _UNSUPPORTED.items():
        if values.get(key, supported) != supported:
            raise ConfigError(f"{source} sets {key}={values[key]!r}; hetfair's BERT supports only {supported!r}")
    if not values.get("tie_word_embeddings", True):
        raise ConfigError(f"{source} unties the MLM decoder from the word embeddings; hetfair's BERT ties them")
    if values.get("hidden_act", "gelu") not in ACTIVATIONS:
        raise ConfigError(f"{source} uses hidden_act {values['hidden_act']!r}; hetfair knows {', '.join(ACTIVATIONS)}")
    known = {f.name for f in fields(BertConfig)}
    if "vocab_size" not in values:
        raise ConfigError(f"{source} has no vocab_size")
    config = BertConfig(**{key: value for key, value in values.items() if key in known})
    config.validate()
    return config


def to_hf_state_dict(state: Mapping[str, torch.Tensor], num_layers: int, nsp: bool) -> dict[str, torch.Tensor]:
    """hetfair ``bert`` parameters under ``BertForPreTraining`` names (tied decoder left out)."""
    names = {**_TOP_LEVEL, **(_NSP if nsp else {})}
    hf = {names[key]: value for key, value in state.items() if key in names}
    for i in range(num_layers):
        ours, theirs = f"layers.{i}.", f"bert.encoder.layer.{i}."
        for kind in ("weight", "bias"):
            query, key, value = state[f"{ours}qkv.{kind}"].chunk(3, dim=0)
            for name, part in (("query", query), ("key", key), ("value", value)):
                hf[f"{theirs}attention.self.{name}.{kind}"] = part
            for our_suffix, their_suffix in _LAYER.items():
                hf[f"{theirs}{their_suffix}.{kind}"] = state[f"{ours}{our_suffix}.{kind}"]
    return {key: value.detach().contiguous().clone() for key, value in hf.items()}


def from_hf_state_dict(hf: Mapping[str, torch.Tensor], num_layers: int, nsp: bool,
                       source: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """hetfair ``bert`` parameters from ``BertForPreTraining``/``BertForMaskedLM``/``BertModel`` names.

    Returns the state dict and the hetfair names it could not fill (the NSP head of a model saved
    without one, say); a missing encoder or embedding weight is a :class:`CheckpointError`.
    """
    if not any(key.startswith("bert.") for key in hf):  # a bare BertModel: no "bert." prefix, no heads
        hf = {f"bert.{key}": value for key, value in hf.items()}
    wanted = {**_TOP_LEVEL, **(_NSP if nsp else {})}
    state: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    for ours, theirs in wanted.items():
        if theirs in hf:
            state[ours] = hf[theirs]
        else:
            missing.append(ours)
    for i in range(num_layers):
        ours, theirs = f"layers.{i}.", f"bert.encoder.layer.{i}."
        for kind in ("weight", "bias"):
            parts = [hf.get(f"{theirs}attention.self.{name}.{kind}") for name in ("query", "key", "value")]
            if any(part is None for part in parts):
                raise CheckpointError(f"{source} lacks the attention weights of encoder layer {i}")
            state[f"{ours}qkv.{kind}"] = torch.cat(parts, dim=0)  # type: ignore[arg-type]
            for our_suffix, their_suffix in _LAYER.items():
                if f"{theirs}{their_suffix}.{kind}" not in hf:
                    raise CheckpointError(f"{source} lacks {theirs}{their_suffix}.{kind}")
                state[f"{ours}{our_suffix}.{kind}"] = hf[f"{theirs}{their_suffix}.{kind}"]
    essential = [name for name in missing if name.startswith("embeddings.")]
    if essential:
        raise CheckpointError(f"{source} lacks {', '.join(wanted[name] for name in essential)}")
    if "embeddings.word.weight" in state:
        state[_TIED] = state["embeddings.word.weight"]
    return state, missing


@dataclass
class HfBert:
    """What a local Hugging Face BERT directory holds."""

    config: BertConfig
    weights: dict[str, torch.Tensor]
    tokens: list[str] | None  # of its vocab.txt or tokenizer.json, if it has one
    architecture: str  # the class that saved it, as config.json names it (e.g. BertModel, BertForMaskedLM)


def read_hf_directory(directory: str) -> HfBert:
    """Config, weights, tokens and architecture of a local Hugging Face BERT directory."""
    config_path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isdir(directory) or not os.path.isfile(config_path):
        raise ConfigError(f"{directory} is not a Hugging Face BERT directory (no {CONFIG_FILE})")
    try:
        with open(config_path, encoding="utf-8") as f:
            values = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{config_path} is not valid JSON: {exc}") from exc
    config = from_hf_config(values, config_path)
    architecture = (values.get("architectures") or ["BERT model"])[0]
    return HfBert(config, _read_weights(directory), hf_vocabulary_tokens(directory), architecture)


def init_report(directory: str, source: HfBert, missing: Sequence[str]) -> list[str]:
    """Lines saying what ``--init-from-hf directory`` loaded and which weights (``missing``) start fresh."""
    shape = source.config
    lines = [f"init | --init-from-hf {directory}: a {source.architecture} of {shape.num_hidden_layers} layers, "
             f"hidden {shape.hidden_size}, {shape.num_attention_heads} heads, intermediate {shape.intermediate_size}, "
             f"vocab {shape.vocab_size}"]
    names = {**_TOP_LEVEL, **_NSP}
    for prefix, (part, pattern) in _HEADS.items():
        fresh = [names[name] for name in missing if name.startswith(prefix)]
        if fresh:
            whole = len(fresh) == sum(name.startswith(prefix) for name in names)
            lines.append(f"init | the {part} ({pattern if whole else ', '.join(fresh)}) starts from random weights: "
                         f"{directory} has none")
    return lines


def _read_weights(directory: str) -> dict[str, torch.Tensor]:
    """The directory's weights, memory-mapped (safetensors maps its file; ``torch.load(mmap=True)``): a tensor is
    read when it is copied, so a deferred build reads each one only when a rank materialises it."""
    safetensors_path = os.path.join(directory, SAFETENSORS_FILE)
    pytorch_path = os.path.join(directory, PYTORCH_FILE)
    try:
        if os.path.isfile(safetensors_path):
            from safetensors.torch import load_file  # optional: pip install 'hetfair[hf]'

            return load_file(safetensors_path)
        if os.path.isfile(pytorch_path):
            return torch.load(pytorch_path, map_location="cpu", weights_only=True, mmap=True)
    except ImportError:
        raise ConfigError("reading model.safetensors needs safetensors: pip install 'hetfair[hf]'") from None
    except Exception as exc:  # noqa: BLE001 - any failure to read the weights is a damaged file
        raise CheckpointError(f"the weights in {directory} cannot be read: {exc}") from exc
    raise ConfigError(f"{directory} holds no {SAFETENSORS_FILE} or {PYTORCH_FILE}")


def write_hf_directory(directory: str, config: BertConfig, state: Mapping[str, torch.Tensor], nsp: bool,
                       pad_token_id: int, tokenizer_files: Mapping[str, str]) -> None:
    """Write ``config.json``, ``model.safetensors`` and ``tokenizer_files`` (name -> text) into ``directory``."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ConfigError("exporting to Hugging Face needs safetensors: pip install 'hetfair[hf]'") from None
    os.makedirs(directory, exist_ok=True)
    hf_state = to_hf_state_dict(state, config.num_hidden_layers, nsp)
    save_file(hf_state, os.path.join(directory, SAFETENSORS_FILE), metadata={"format": "pt"})
    with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(to_hf_config(config, nsp, pad_token_id), f, indent=2)
    for name, text in tokenizer_files.items():
        with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
            f.write(text)


def success_message(outdir: str, nsp: bool) -> str:
    """Where the export went, a shell command that loads it with ``transformers``, and which class fits."""
    model_class = "BertForPreTraining" if nsp else "BertForMaskedLM"
    path = json.dumps(outdir)  # a Python string literal in double quotes, whatever the path holds
    code = (f"from transformers import AutoTokenizer, {model_class}; model = {model_class}.from_pretrained({path}); "
            f"tokenizer = AutoTokenizer.from_pretrained({path})")
    note = ("note: BertForMaskedLM loads it too, without the next-sentence head" if nsp else
            "note: trained without --nsp, so it is a BertForMaskedLM: BertForPreTraining would start its "
            "next-sentence head from random weights")
    return f"wrote {outdir}; load it in Python with:\npython -c {shlex.quote(code)}\n{note}"

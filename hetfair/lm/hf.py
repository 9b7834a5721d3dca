"""Hugging Face ``transformers`` <-> hetfair ``transformer_lm``: configs, parameter names, directories.

Learned positions are GPT-2's architecture exactly: ``GPT2LMHeadModel``. Rotary positions are
written as ``GPTNeoXForCausalLM`` with ``use_parallel_residual=False``: like hetfair's layers it
has LayerNorm (with bias), a GELU feed-forward block with biases, biased attention projections
and sequential pre-LayerNorm residuals, and rotates the whole head (``partial_rotary_factor=1``)
with the half-split layout used here. ``LlamaForCausalLM`` would not fit: it has RMSNorm, a
gated SwiGLU feed-forward block and no biases, another architecture.

GPT-2 stores its projections as ``Conv1D`` (``in, out`` matrices: transposed here); GPT-NeoX
interleaves query, key and value per head in ``query_key_value`` (hetfair keeps all queries,
then all keys, then all values). The output projection is tied to the token embeddings on both
sides. ``transformers`` is imported only by the functions that need it: the plain model does not.
"""

from __future__ import annotations

import json
import os
import shlex
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch

from hetfair.errors import CheckpointError, ConfigError, first_line
from hetfair.lm.config import LMConfig

if TYPE_CHECKING:
    from hetfair.lm.model import TransformerLM
    from hetfair.tasks import Task

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
MODEL_CLASSES = {"learned": "GPT2LMHeadModel", "rotary": "GPTNeoXForCausalLM"}
_MODEL_TYPES = {"gpt2": "learned", "gpt_neox": "rotary"}
# hetfair activation -> transformers' name of the same function; on import, GPT-2's own gelu_new too
_ACTIVATION_TO_HF = {"gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu", "relu": "relu"}
_ACTIVATION_FROM_HF = {"gelu_new": "gelu_tanh", **{hf: ours for ours, hf in _ACTIVATION_TO_HF.items()}}
_TIED = "lm_head.weight"  # the token embeddings, on both sides

# hetfair name -> (GPT-2 name, whether transposed: Conv1D)
_GPT2_TOP = {"embed_tokens.weight": "transformer.wte.weight", "embed_positions.weight": "transformer.wpe.weight",
             "final_norm.weight": "transformer.ln_f.weight", "final_norm.bias": "transformer.ln_f.bias"}
_GPT2_LAYER = {"attention_norm": ("ln_1", False), "qkv": ("attn.c_attn", True), "attention_out": ("attn.c_proj", True),
               "ffn_norm": ("ln_2", False), "ffn_in": ("mlp.c_fc", True), "ffn_out": ("mlp.c_proj", True)}
_NEOX_TOP = {"embed_tokens.weight": "gpt_neox.embed_in.weight", "final_norm.weight": "gpt_neox.final_layer_norm.weight",
             "final_norm.bias": "gpt_neox.final_layer_norm.bias"}
_NEOX_LAYER = {"attention_norm": "input_layernorm", "qkv": "attention.query_key_value",
               "attention_out": "attention.dense", "ffn_norm": "post_attention_layernorm",
               "ffn_in": "mlp.dense_h_to_4h", "ffn_out": "mlp.dense_4h_to_h"}


def to_hf_config(config: LMConfig, eos_token_id: int, pad_token_id: int | None) -> dict[str, Any]:
    """The ``config.json`` values of the transformers model with this architecture."""
    tokens = {"bos_token_id": eos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id,
              "tie_word_embeddings": True, "architectures": [MODEL_CLASSES[config.positions]]}
    if config.positions == "learned":
        return {"model_type": "gpt2", "vocab_size": config.vocab_size, "n_positions": config.max_positions,
                "n_embd": config.embed_dim, "n_layer": config.layers, "n_head": config.attention_heads,
                "n_inner": config.ffn_embed_dim, "activation_function": _ACTIVATION_TO_HF[config.activation_fn],
                "resid_pdrop": config.dropout, "embd_pdrop": config.dropout, "attn_pdrop": config.attention_dropout,
                "layer_norm_epsilon": config.layer_norm_eps, "initializer_range": config.init_std, **tokens}
    return {"model_type": "gpt_neox", "vocab_size": config.vocab_size,
            "max_position_embeddings": config.max_positions, "hidden_size": config.embed_dim,
            "num_hidden_layers": config.layers, "num_attention_heads": config.attention_heads,
            "intermediate_size": config.ffn_embed_dim, "hidden_act": _ACTIVATION_TO_HF[config.activation_fn],
            "hidden_dropout": config.dropout, "attention_dropout": config.attention_dropout,
            "layer_norm_eps": config.layer_norm_eps, "initializer_range": config.init_std,
            "use_parallel_residual": False, "attention_bias": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": config.rotary_base,
                                "partial_rotary_factor": 1.0}, **tokens}


def from_hf_config(values: Mapping[str, Any], source: str, dropout: float, attention_dropout: float) -> LMConfig:
    """The :class:`LMConfig` of a transformers ``config.json`` (dropout as given).

    What hetfair cannot build is a :class:`ConfigError`."""
    model_type = values.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise ConfigError(f"{source} holds a '{model_type}' model; --init-from-hf reads GPT-2 (model_type gpt2) or "
                          f"GPT-NeoX (gpt_neox, use_parallel_residual false) directories")
    if not values.get("tie_word_embeddings", model_type == "gpt2"):
        raise ConfigError(f"{source} has an output layer untied from the token embeddings; hetfair's transformer_lm "
                          f"ties them")
    activation_key = "activation_function" if model_type == "gpt2" else "hidden_act"
    activation = values.get(activation_key, "gelu_new" if model_type == "gpt2" else "gelu")
    if activation not in _ACTIVATION_FROM_HF:
        raise ConfigError(f"{source} uses {activation_key} {activation!r}; hetfair's transformer_lm knows "
                          f"{', '.join(_ACTIVATION_FROM_HF)}")
    common = {"activation_fn": _ACTIVATION_FROM_HF[activation], "dropout": dropout,
              "attention_dropout": attention_dropout, "init_std": values.get("initializer_range", 0.02)}
    try:
        config = (_gpt2_config if model_type == "gpt2" else _neox_config)(values, source, common)
    except KeyError as exc:
        raise ConfigError(f"{source} has no {exc.args[0]}") from None
    config.validate()
    return config


def _gpt2_config(values: Mapping[str, Any], source: str, common: dict[str, Any]) -> LMConfig:
    _refuse(values, source, {"add_cross_attention": False, "scale_attn_weights": True,
                             "scale_attn_by_inverse_layer_idx": False})
    embed_dim = values.get("n_embd", 768)
    return LMConfig(vocab_size=values["vocab_size"], positions="learned", max_positions=values.get("n_positions", 1024),
                    embed_dim=embed_dim, layers=values.get("n_layer", 12), attention_heads=values.get("n_head", 12),
                    ffn_embed_dim=values.get("n_inner") or 4 * embed_dim,
                    layer_norm_eps=values.get("layer_norm_epsilon", 1e-5), **common)


def _neox_config(values: Mapping[str, Any], source: str, common: dict[str, Any]) -> LMConfig:
    rope = values.get("rope_parameters") or values.get("rope_scaling") or {}
    _refuse(values, source, {"use_parallel_residual": False, "attention_bias": True})
    _refuse({"rope_type": rope.get("rope_type", "default"),  # transformers' defaults where the file has none
             "partial_rotary_factor": rope.get("partial_rotary_factor", values.get("rotary_pct", 0.25))},
            source, {"rope_type": "default", "partial_rotary_factor": 1.0})
    return LMConfig(vocab_size=values["vocab_size"], positions="rotary",
                    max_positions=values.get("max_position_embeddings", 2048), embed_dim=values["hidden_size"],
                    layers=values["num_hidden_layers"], attention_heads=values["num_attention_heads"],
                    ffn_embed_dim=values["intermediate_size"],
                    rotary_base=rope.get("rope_theta", values.get("rotary_emb_base", 10000.0)),
                    layer_norm_eps=values.get("layer_norm_eps", 1e-5), **common)


def _refuse(values: Mapping[str, Any], source: str, supported: Mapping[str, Any]) -> None:
    for key, value in supported.items():
        if key in values and values[key] != value:
            raise ConfigError(f"{source} sets {key}={values[key]!r}; hetfair's transformer_lm supports only {value!r}")


def to_hf_state_dict(state: Mapping[str, torch.Tensor], config: LMConfig) -> dict[str, torch.Tensor]:
    """hetfair parameters under the transformers model's names (the tied output layer left out)."""
    hf: dict[str, torch.Tensor] = {}
    if config.positions == "learned":
        hf.update({theirs: state[ours] for ours, theirs in _GPT2_TOP.items()})
        for i in range(config.layers):
            for ours, (theirs, transposed) in _GPT2_LAYER.items():
                weight = state[f"layers.{i}.{ours}.weight"]
                hf[f"transformer.h.{i}.{theirs}.weight"] = weight.t() if transposed else weight
                hf[f"transformer.h.{i}.{theirs}.bias"] = state[f"layers.{i}.{ours}.bias"]
    else:
        hf.update({theirs: state[ours] for ours, theirs in _NEOX_TOP.items()})
        for i in range(config.layers):
            for ours, theirs in _NEOX_LAYER.items():
                for kind in ("weight", "bias"):
                    value = state[f"layers.{i}.{ours}.{kind}"]
                    hf[f"gpt_neox.layers.{i}.{theirs}.{kind}"] = _per_head(value, config) if ours == "qkv" else value
    return {name: value.detach().contiguous().clone() for name, value in hf.items()}


def from_hf_state_dict(hf: Mapping[str, torch.Tensor], config: LMConfig, source: str) -> dict[str, torch.Tensor]:
    """hetfair parameters from the transformers model's; a missing weight is a :class:`CheckpointError`."""
    def get(name: str) -> torch.Tensor:
        if name not in hf:
            raise CheckpointError(f"{source} lacks the weight {name}")
        return hf[name]

    state: dict[str, torch.Tensor] = {}
    if config.positions == "learned":
        state.update({ours: get(theirs) for ours, theirs in _GPT2_TOP.items()})
        for i in range(config.layers):
            for ours, (theirs, transposed) in _GPT2_LAYER.items():
                weight = get(f"transformer.h.{i}.{theirs}.weight")
                state[f"layers.{i}.{ours}.weight"] = weight.t() if transposed else weight
                state[f"layers.{i}.{ours}.bias"] = get(f"transformer.h.{i}.{theirs}.bias")
    else:
        state.update({ours: get(theirs) for ours, theirs in _NEOX_TOP.items()})
        for i in range(config.layers):
            for ours, theirs in _NEOX_LAYER.items():
                for kind in ("weight", "bias"):
                    value = get(f"gpt_neox.layers.{i}.{theirs}.{kind}")
                    state[f"layers.{i}.{ours}.{kind}"] = _per_kind(value, config) if ours == "qkv" else value
    return {name: value.detach().float().contiguous().clone() for name, value in state.items()}


def _per_head(qkv: torch.Tensor, config: LMConfig) -> torch.Tensor:
    """hetfair's ``(q | k | v)`` rows -> GPT-NeoX's ``(q, k, v)`` rows of each head in turn."""
    rest = qkv.shape[1:]
    return qkv.reshape(3, config.attention_heads, config.head_dim, *rest).transpose(0, 1).reshape(qkv.shape)


def _per_kind(qkv: torch.Tensor, config: LMConfig) -> torch.Tensor:
    """The inverse of :func:`_per_head`."""
    rest = qkv.shape[1:]
    return qkv.reshape(config.attention_heads, 3, config.head_dim, *rest).transpose(0, 1).reshape(qkv.shape)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError("Hugging Face interop needs transformers: pip install 'hetfair[hf]'") from None
    return transformers


@contextmanager
def _no_progress_bars(transformers: Any) -> Iterator[None]:
    """Keep transformers' per-file progress bars out of hetfair's output (restored after)."""
    enabled = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            transformers.utils.logging.enable_progress_bar()


@dataclass
class HfLM:
    """What a local transformers causal-LM directory holds, in hetfair's terms."""

    config: LMConfig
    state_dict: dict[str, torch.Tensor]
    architecture: str  # the class that saved it, as config.json names it


def read_hf_directory(directory: str, dropout: float, attention_dropout: float) -> HfLM:
    """Config and weights of a local ``GPT2LMHeadModel`` / ``GPTNeoXForCausalLM`` directory (loaded by transformers)."""
    config_path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ConfigError(f"--init-from-hf {directory} is not a Hugging Face model directory (no {CONFIG_FILE})")
    try:
        with open(config_path, encoding="utf-8") as f:
            values = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{config_path} is not valid JSON: {first_line(exc)}") from exc
    if not isinstance(values, dict):
        raise ConfigError(f"{config_path} must hold a JSON object")
    config = from_hf_config(values, config_path, dropout, attention_dropout)
    transformers = _transformers()
    try:
        with _no_progress_bars(transformers):
            model, info = transformers.AutoModelForCausalLM.from_pretrained(
                directory, local_files_only=True, dtype=torch.float32, output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"--init-from-hf {directory}: transformers cannot load it: {first_line(exc)}") from exc
    missing = [name for name in info["missing_keys"] if name != _TIED]
    if missing or info["mismatched_keys"]:
        raise CheckpointError(f"--init-from-hf {directory} lacks or misshapes weights: "
                              f"{', '.join(missing + [str(m[0]) for m in info['mismatched_keys']])}")
    architecture = (values.get("architectures") or [type(model).__name__])[0]
    return HfLM(config, from_hf_state_dict(model.state_dict(), config, directory), architecture)


def check_same_tokenizer(directory: str, task: "Task") -> None:
    """Refuse an ``--init-from-hf`` directory whose ``tokenizer.json`` has another vocabulary than the task's."""
    path = os.path.join(directory, TOKENIZER_FILE)
    if not os.path.isfile(path):
        return
    from tokenizers import Tokenizer

    if Tokenizer.from_file(path).get_vocab() != task.tokenizer.get_vocab():  # type: ignore[attr-defined]
        raise ConfigError(f"--init-from-hf {directory}: its {TOKENIZER_FILE} has another vocabulary than --data's; "
                          f"preprocess the text with its {TOKENIZER_FILE}")


def write_hf_directory(model: "TransformerLM", outdir: str, task: "Task") -> str:
    """Write ``model`` and the task's tokenizer as a transformers directory; return what to tell the user."""
    transformers = _transformers()
    config = model.config
    tokenizer = task.tokenizer  # type: ignore[attr-defined]
    eos, pad = task.eos_index, getattr(task, "pad_index", None)  # type: ignore[attr-defined]
    hf_config = transformers.AutoConfig.for_model(**to_hf_config(config, eos, pad))
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_config)
    state = {name: value.float() for name, value in to_hf_state_dict(model.state_dict(), config).items()}
    result = hf_model.load_state_dict(state, strict=False, assign=True)
    if result.unexpected_keys or set(result.missing_keys) - {_TIED}:
        raise ConfigError(f"the {MODEL_CLASSES[config.positions]} layout does not fit this model: missing "
                          f"{result.missing_keys}, unexpected {result.unexpected_keys}")
    hf_model.tie_weights()
    os.makedirs(outdir, exist_ok=True)
    with _no_progress_bars(transformers):
        hf_model.save_pretrained(outdir)
    special = {"eos_token": tokenizer.id_to_token(eos), "bos_token": tokenizer.id_to_token(eos)}
    if pad is not None:
        special["pad_token"] = tokenizer.id_to_token(pad)
    tokenizer_file = str(task.tokenizer_file)  # type: ignore[attr-defined]
    hf_tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=tokenizer_file,
                                                        model_max_length=config.max_positions, **special)
    hf_tokenizer.save_pretrained(outdir)
    return success_message(outdir, MODEL_CLASSES[config.positions])


def success_message(outdir: str, model_class: str) -> str:
    """Where the export went and a shell command that loads it with ``transformers``."""
    path = json.dumps(outdir)  # a Python string literal in double quotes, whatever the path holds
    code = (f"from transformers import AutoTokenizer, {model_class}; model = {model_class}.from_pretrained({path}); "
            f"tokenizer = AutoTokenizer.from_pretrained({path})")
    return (f"wrote {outdir}; load it in Python with:\npython -c {shlex.quote(code)}\n"
            f"note: AutoModelForCausalLM.from_pretrained loads it too")

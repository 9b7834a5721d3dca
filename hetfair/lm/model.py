"""A decoder-only transformer language model (GPT-2's layout): ``--arch gpt_tiny | gpt_mini | gpt2_small``.

Pre-LayerNorm layers of causal self-attention (``scaled_dot_product_attention`` with
``is_causal=True``) and a GELU feed-forward block, a final LayerNorm, and the output
projection tied to the token embeddings. Positions are learned (a table of
``--max-target-positions`` embeddings, as GPT-2) or rotary (``--positions rotary``:
RoPE on queries and keys, as GPT-NeoX, and no position table).

Hyper-parameters come, in increasing priority, from the flag defaults (GPT-2 small's),
the ``--arch`` preset, explicit flags and ``--init-from-hf DIR`` (a transformers
``GPT2LMHeadModel`` or ``GPTNeoXForCausalLM`` directory). The effective values are written
back to ``args`` so that checkpoints record the model actually built.
"""

from __future__ import annotations

import argparse
import logging
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from hetfair.errors import ConfigError
from hetfair.lm.config import ACTIVATIONS, POSITIONS, LMConfig
from hetfair.models import register_model, register_model_architecture
from hetfair.models.deferred_init import real_tensors
from hetfair.models.model import HetfairModel
from hetfair.parallel.pipeline_stage import PipelineStage, units_dict

if TYPE_CHECKING:
    from hetfair.tasks import Task

logger = logging.getLogger(__name__)

# flag destination -> LMConfig field (besides --max-target-positions); fairseq's transformer_lm names
_FLAGS = {
    "decoder_embed_dim": "embed_dim",
    "decoder_layers": "layers",
    "decoder_attention_heads": "attention_heads",
    "decoder_ffn_embed_dim": "ffn_embed_dim",
    "positions": "positions",
    "rotary_base": "rotary_base",
    "activation_fn": "activation_fn",
    "dropout": "dropout",
    "attention_dropout": "attention_dropout",
}
_HELP = {
    "embed_dim": "width of the model (embeddings and residual stream)",
    "layers": "number of decoder layers",
    "attention_heads": "attention heads per layer",
    "ffn_embed_dim": "width of the feed-forward layers",
    "positions": f"position encoding: {' or '.join(POSITIONS)}",
    "rotary_base": "base of the rotary frequencies (--positions rotary)",
    "activation_fn": f"feed-forward activation: {', '.join(ACTIVATIONS)}",
    "dropout": "dropout on the embeddings and each residual branch (0 turns it off)",
    "attention_dropout": "dropout on attention probabilities (0 turns it off)",
}


def rotary_cos_sin(length: int, head_dim: int, base: float, device: torch.device,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's ``(length, head_dim)`` cosines and sines, frequencies repeated over both halves (GPT-NeoX's layout)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each ``(i, i + head_dim/2)`` pair of ``x`` (``batch, heads, length, head_dim``) by its angle."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class DecoderLayer(nn.Module):
    """Pre-LayerNorm layer: ``x + attention(norm(x))``, then ``x + ffn(norm(x))``."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.num_heads = config.attention_heads
        self.attention_dropout = config.attention_dropout
        self.attention_norm = nn.LayerNorm(config.embed_dim, eps=config.layer_norm_eps)
        self.qkv = nn.Linear(config.embed_dim, 3 * config.embed_dim)
        self.attention_out = nn.Linear(config.embed_dim, config.embed_dim)
        self.ffn_norm = nn.LayerNorm(config.embed_dim, eps=config.layer_norm_eps)
        self.ffn_in = nn.Linear(config.embed_dim, config.ffn_embed_dim)
        self.ffn_out = nn.Linear(config.ffn_embed_dim, config.embed_dim)
        self.activation = ACTIVATIONS[config.activation_fn]
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).view(batch, length, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        attended = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.attention_dropout if self.training else 0.0, is_causal=True)
        x = x + self.dropout(self.attention_out(attended.transpose(1, 2).reshape(batch, length, width)))
        return x + self.dropout(self.ffn_out(self.activation(self.ffn_in(self.ffn_norm(x)))))


class LMParts(nn.Module):
    """The input and output ends of the decoder, shared by :class:`TransformerLM` and its pipeline stages
    (:mod:`hetfair.lm.pipeline`), which hold the same modules under the same names."""

    config: LMConfig
    embed_tokens: nn.Embedding

    def embed(self, src_tokens: torch.Tensor) -> torch.Tensor:
        """Token (and learned position) embeddings of ``(batch, length)`` ids, after dropout."""
        length = src_tokens.shape[1]
        if length > self.config.max_positions:
            raise ConfigError(f"an input of {length} tokens is longer than the model's {self.config.max_positions} "
                              f"positions")
        x = self.embed_tokens(src_tokens)
        if self.config.positions == "learned":
            x = x + self.embed_positions(torch.arange(length, device=src_tokens.device))
        return self.dropout(x)

    def rotary(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """RoPE's cosines and sines for hidden states ``x`` (``None`` with learned positions)."""
        if self.config.positions == "learned":
            return None
        return rotary_cos_sin(x.shape[1], self.config.head_dim, self.config.rotary_base, x.device, x.dtype)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Scores of each next token: the final norm, then the (tied) token embeddings."""
        return F.linear(self.final_norm(x), self.embed_tokens.weight)


@register_model("transformer_lm")
class TransformerLM(LMParts, HetfairModel):
    """Decoder-only transformer: ``model(src_tokens) -> logits`` over the next token at every position."""

    init_source_options = ("init_from_hf",)

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.embed_dim)
        if config.positions == "learned":
            self.embed_positions = nn.Embedding(config.max_positions, config.embed_dim)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.layers))
        self.final_norm = nn.LayerNorm(config.embed_dim, eps=config.layer_norm_eps)
        self.apply(self._init_weights)
        residual_std = config.init_std / math.sqrt(2 * config.layers)  # GPT-2: each residual branch scaled down
        for layer in self.layers:
            for projection in (layer.attention_out, layer.ffn_out):
                nn.init.normal_(projection.weight, std=residual_std)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.init_std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def sharding_units(self) -> list[nn.Module]:
        """One unit per decoder layer; the (tied) embeddings and the final norm stay in the root unit."""
        return list(self.layers)

    @property
    def max_positions(self) -> int:
        """The longest input this model takes."""
        return self.config.max_positions

    def forward(self, src_tokens: torch.Tensor) -> torch.Tensor:
        """``(batch, length)`` token ids -> ``(batch, length, vocab)`` scores of each next token (causal)."""
        x = self.embed(src_tokens)
        rotary = self.rotary(x)
        for layer in self.layers:
            x = layer(x, rotary)
        return self.head(x)

    def pipeline_stage(self, units: range, first: bool, last: bool) -> PipelineStage:
        return LMStage(self, units, first, last)

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        defaults = LMConfig(vocab_size=1)
        for dest, name in _FLAGS.items():
            value = getattr(defaults, name)
            parser.add_argument(f"--{dest.replace('_', '-')}", type=type(value), default=value,
                                metavar=type(value).__name__.upper(), help=_HELP[name],
                                **({"choices": POSITIONS} if name == "positions" else {}))
        parser.add_argument("--max-target-positions", type=int, metavar="N",
                            help="longest input the model takes, the context generation may fill "
                                 "(default: --tokens-per-sample)")
        parser.add_argument("--init-from-hf", metavar="DIR",
                            help="start from a local transformers GPT2LMHeadModel (learned positions) or "
                                 "GPTNeoXForCausalLM (rotary) directory: its config.json sizes the model, "
                                 "its weights initialise it")

    @classmethod
    def build_model(cls, args: argparse.Namespace, task: "Task") -> "TransformerLM":
        if getattr(args, "init_from_hf", None):
            return cls.from_hugging_face(args, task)
        max_positions = getattr(args, "max_target_positions", None) or task.max_positions()
        if max_positions is None:
            raise ConfigError("the task gives no sample length; set --max-target-positions")
        config = LMConfig(vocab_size=task.vocab_size, max_positions=max_positions,  # type: ignore[attr-defined]
                          **{name: getattr(args, dest) for dest, name in _FLAGS.items()})
        _check_fits(config, task)
        _record(args, config)
        return cls(config)

    @classmethod
    def from_hugging_face(cls, args: argparse.Namespace, task: "Task") -> "TransformerLM":
        """The model of ``--init-from-hf DIR``: sized by its ``config.json``, initialised with its weights."""
        from hetfair.lm.hf import check_same_tokenizer, read_hf_directory

        directory = args.init_from_hf
        check_same_tokenizer(directory, task)
        with real_tensors():  # transformers builds its model on the CPU, also inside a deferred build
            source = read_hf_directory(directory, dropout=args.dropout, attention_dropout=args.attention_dropout)
        vocab_size = task.vocab_size  # type: ignore[attr-defined]
        if source.config.vocab_size != vocab_size:
            raise ConfigError(f"--init-from-hf {directory} has a vocabulary of {source.config.vocab_size} tokens but "
                              f"--data has {vocab_size}; preprocess with its tokenizer.json")
        _check_fits(source.config, task)
        _record(args, source.config)
        model = cls(source.config)
        model.load_state_dict(source.state_dict)
        logger.info(f"init | --init-from-hf {directory}: a {source.architecture} of {source.config.layers} layers, "
                    f"width {source.config.embed_dim}, {source.config.attention_heads} heads, "
                    f"{source.config.positions} positions, vocab {source.config.vocab_size}")
        return model

    def export_hf(self, outdir: str, task: "Task") -> str:
        """A ``GPT2LMHeadModel`` (learned positions) or ``GPTNeoXForCausalLM`` (rotary) directory with the tokenizer."""
        from hetfair.lm.hf import write_hf_directory

        return write_hf_directory(self, outdir, task)


def _check_fits(config: LMConfig, task: "Task") -> None:
    samples = task.max_positions()
    if samples is not None and samples > config.max_positions:
        raise ConfigError(f"samples of {samples} tokens do not fit the model's {config.max_positions} positions; "
                          f"lower --tokens-per-sample or raise --max-target-positions")


def _record(args: argparse.Namespace, config: LMConfig) -> None:
    """Write the sizes actually built back to ``args`` (the checkpoint's options rebuild this model)."""
    vars(args).update({dest: getattr(config, name) for dest, name in _FLAGS.items()},
                      max_target_positions=config.max_positions)


def _arch(embed_dim: int, layers: int, heads: int) -> dict[str, int]:
    return {"decoder_embed_dim": embed_dim, "decoder_layers": layers, "decoder_attention_heads": heads,
            "decoder_ffn_embed_dim": 4 * embed_dim}


@register_model_architecture("transformer_lm", "gpt_tiny")
def gpt_tiny() -> dict[str, int]:
    return _arch(64, 2, 2)


@register_model_architecture("transformer_lm", "gpt_mini")
def gpt_mini() -> dict[str, int]:
    return _arch(256, 4, 4)


@register_model_architecture("transformer_lm", "gpt2_small")
def gpt2_small() -> dict[str, int]:
    return _arch(768, 12, 12)


class LMStage(LMParts, PipelineStage):
    """Decoder layers ``units`` of ``model``; the embeddings on the first stage, the final norm and the tied
    output projection on the last."""

    def __init__(self, model: TransformerLM, units: range, first: bool, last: bool) -> None:
        PipelineStage.__init__(self, first, last)
        self.config = model.config
        if first or last:
            self.embed_tokens = model.embed_tokens
        if first:
            if model.config.positions == "learned":
                self.embed_positions = model.embed_positions
            self.dropout = model.dropout
        self.layers = units_dict(model.layers, units)
        if last:
            self.final_norm = model.final_norm

    def forward(self, *activations: torch.Tensor, src_tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(src_tokens) if self.first else activations[0]
        rotary = self.rotary(x)
        for layer in self.layers.values():
            x = layer(x, rotary)
        return self.head(x) if self.last else x.float()

    def boundary(self, net_input: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        batch, length = net_input["src_tokens"].shape
        return (torch.empty(batch, length, self.config.embed_dim, device="meta"),)

    def tied_rows(self, inputs: dict[str, Any]) -> torch.Tensor:
        return inputs["src_tokens"]

    def output_work(self) -> float:
        """The output projection multiplies each position by the vocabulary's embeddings, a layer by its weights:
        their sizes' ratio."""
        layer = sum(param.numel() for param in next(iter(self.layers.values())).parameters())
        return self.embed_tokens.weight.numel() / layer

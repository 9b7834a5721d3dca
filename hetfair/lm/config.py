"""The decoder-only language model's hyper-parameters (:class:`LMConfig`) and its activations.

Shared by the model (:mod:`hetfair.lm.model`) and the Hugging Face conversion
(:mod:`hetfair.lm.hf`), which import this module and not each other's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from hetfair.errors import ConfigError

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's ("gelu_new" in transformers)
    "gelu": F.gelu,
    "relu": F.relu,
}
POSITIONS = ("learned", "rotary")


@dataclass
class LMConfig:
    """Sizes and settings of :class:`~hetfair.lm.model.TransformerLM` (defaults: GPT-2 small's)."""

    vocab_size: int
    max_positions: int = 1024
    """Longest input: the size of the learned position table, the context generation may fill."""
    embed_dim: int = 768
    layers: int = 12
    attention_heads: int = 12
    ffn_embed_dim: int = 3072
    positions: str = "learned"
    """``learned`` (an embedding per position, as GPT-2) or ``rotary`` (RoPE on queries and keys)."""
    rotary_base: float = 10000.0
    activation_fn: str = "gelu_tanh"
    dropout: float = 0.1
    """On the embeddings and each residual branch."""
    attention_dropout: float = 0.1
    layer_norm_eps: float = 1e-5
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.attention_heads

    def validate(self) -> None:
        """Refuse settings no model can be built with, in one line naming the flag."""
        if self.positions not in POSITIONS:
            raise ConfigError(f"--positions {self.positions}: choose one of {', '.join(POSITIONS)}")
        if self.activation_fn not in ACTIVATIONS:
            raise ConfigError(f"--activation-fn {self.activation_fn}: choose one of {', '.join(ACTIVATIONS)}")
        for flag, value in (("--decoder-embed-dim", self.embed_dim), ("--decoder-layers", self.layers),
                            ("--decoder-attention-heads", self.attention_heads),
                            ("--decoder-ffn-embed-dim", self.ffn_embed_dim),
                            ("--max-target-positions", self.max_positions), ("vocabulary size", self.vocab_size)):
            if value < 1:
                raise ConfigError(f"{flag} must be at least 1, got {value}")
        if self.embed_dim % self.attention_heads:
            raise ConfigError(f"--decoder-embed-dim {self.embed_dim} is not a multiple of --decoder-attention-heads "
                              f"{self.attention_heads}")
        if self.positions == "rotary" and self.head_dim % 2:
            raise ConfigError(f"rotary positions need an even head size, got {self.head_dim} "
                              f"(--decoder-embed-dim / --decoder-attention-heads)")
        for flag, value in (("--dropout", self.dropout), ("--attention-dropout", self.attention_dropout)):
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"{flag} must be in [0, 1), got {value}")
        if self.rotary_base <= 1.0:
            raise ConfigError(f"--rotary-base must be above 1, got {self.rotary_base}")

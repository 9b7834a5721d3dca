"""``--compile``: ``torch.compile`` a model in place, once for every batch size.

The model is compiled with ``nn.Module.compile`` rather than wrapped by
``torch.compile(model)``: the module stays the same object, so its
``state_dict`` keys carry no ``_orig_mod.`` prefix and checkpoints load into
an eager model and back. ``dynamic=True`` makes the batch dimension (and a
padded sequence length) symbolic from the first compile: per-rank batch sizes
that differ between ranks, a re-split by ``--auto-balance`` or a short last
batch reuse the same code instead of recompiling (torch would otherwise
recompile on the first new size and, after ``cache_size_limit`` sizes, fall
back to eager).
"""

from __future__ import annotations

import torch.fx.experimental._config as shape_config
from torch import nn


def compile_model(model: nn.Module) -> None:
    """Compile ``model``'s forward in place (lazily: the first call compiles)."""
    # Duck shaping gives equal sizes one symbol: a batch of 8 rows of 8 features, or of 128
    # sequences of 128 tokens, would tie the batch size to a weight's size and recompile for the next.
    shape_config.use_duck_shape = False
    model.compile(dynamic=True)

"""``--activation-checkpointing 1``: each sharding unit recomputes its activations in the backward.

torch's checkpoint wrapper (non-reentrant ``torch.utils.checkpoint``, the random state kept
for the recomputation) replaces each unit in its parent, before a strategy shards or
wraps the model, so it composes with every ``--ddp-backend``. The wrapper strips its own
name from state dicts, so checkpoints keep the plain parameter names.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

from hetfair.errors import ConfigError
from hetfair.models.model import HetfairModel


def checkpoint_units(model: nn.Module) -> None:
    """Wrap each of ``model``'s sharding units (:meth:`HetfairModel.sharding_units`) in place; a model
    without units is refused (nothing would be saved)."""
    units = model.sharding_units() if isinstance(model, HetfairModel) else []
    if not units:
        raise ConfigError(f"--activation-checkpointing 1: model {type(model).__name__} has no sharding units "
                          f"(its sharding_units() is empty) to recompute; drop --activation-checkpointing")
    chosen = {id(unit) for unit in units}
    apply_activation_checkpointing(model, check_fn=lambda module: id(module) in chosen)

"""Fully sharded data parallel (``--ddp-backend fully_sharded``): torch's FSDP2 ``fully_shard``.

Parameters, gradients and optimizer state are sharded over the ranks: each rank keeps
``1/N`` of each, gathers a unit's parameters for its forward and backward, and
reduce-scatters its gradients. Units are the modules a model names in
:meth:`~hetfair.models.HetfairModel.sharding_units` (BERT: each encoder layer), then the
root takes whatever is left (embeddings and heads, tied weights together).

Checkpoints stay portable: the model's and the optimizer's *full* state dicts are gathered to
rank 0 in the plain ``torch.optim`` format (parameters by index), the same format an unsharded
or ZeRO-1 run writes, so any run can resume from any other, on any world size.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)  # full tensors, on rank 0 only
_LOAD = StateDictOptions(full_state_dict=True)  # every rank holds the full state and keeps its shard


def shard_model(model: nn.Module, units: Sequence[nn.Module], reshard_after_forward: bool) -> None:
    """Shard ``units`` one by one, then ``model`` itself (in place)."""
    for unit in units:
        fully_shard(unit, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Reduce-scatter gradients in this backward (the last micro-batch) or keep accumulating locally."""
    model.set_requires_gradient_sync(enabled)  # type: ignore[operator]


def local_tensors(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's shards of (possibly) sharded tensors, for in-place arithmetic."""
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def total_norm(grads: Sequence[torch.Tensor]) -> float:
    """The global 2-norm of all gradients, shards included (a collective when they are sharded)."""
    if not grads:
        return 0.0
    return _full_float(torch.nn.utils.get_total_norm(list(grads)))


def clip_grad_norm(params: Sequence[nn.Parameter], max_norm: float) -> float:
    """``clip_grad_norm_`` over sharded parameters; returns the global norm before clipping."""
    return _full_float(torch.nn.utils.clip_grad_norm_(list(params), max_norm))


def _full_float(value: torch.Tensor) -> float:
    return float(value.full_tensor() if isinstance(value, DTensor) else value)


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model state on rank 0 (``{}`` elsewhere); a collective."""
    return get_model_state_dict(model, options=_GATHER)


def load_full_model_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load an unsharded model state (present on every rank); each rank keeps its shards."""
    set_model_state_dict(model, state, options=_LOAD)


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                              params: Sequence[nn.Parameter]) -> dict[str, Any]:
    """The unsharded optimizer state on rank 0 in plain ``torch.optim`` format; a collective."""
    state = get_optimizer_state_dict(model, optimizer, options=_GATHER)
    index = {name: i for i, name in enumerate(_names(model, params))}
    return {
        "state": {index[name]: value for name, value in state.get("state", {}).items()},
        "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                         for group in state.get("param_groups", [])],
    }


def load_full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                                   params: Sequence[nn.Parameter], state: dict[str, Any]) -> None:
    """Load a plain-format optimizer state (present on every rank); each rank keeps its shards."""
    names = _names(model, params)
    fqn_state = {
        "state": {names[int(i)]: value for i, value in state["state"].items()},
        "param_groups": [{**group, "params": [names[int(i)] for i in group["params"]]}
                         for group in state["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, fqn_state, options=_LOAD)


def _names(model: nn.Module, params: Sequence[nn.Parameter]) -> list[str]:
    """The fully qualified name of each of ``params``, in their order (the optimizer's indices)."""
    by_id = {id(param): name for name, param in model.named_parameters()}
    return [by_id[id(param)] for param in params]

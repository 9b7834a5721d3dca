"""Fully sharded data parallel (``--ddp-backend fully_sharded``): torch's FSDP2 ``fully_shard``.

Parameters, gradients and optimizer state are sharded over the ranks: each rank keeps
``1/N`` of each, gathers a unit's parameters for its forward and backward, and
reduce-scatters its gradients. Units are the modules a model names in
:meth:`~hetfair.models.HetfairModel.sharding_units` (BERT: each encoder layer), then the
root takes whatever is left (embeddings and heads, tied weights together).

Hybrid sharding (``--ddp-backend hybrid_sharded``) runs the same on a 2-D device mesh: a unit
is sharded over the ranks of one node and replicated over the nodes, so its gradient is
reduce-scattered inside each node and only the shard is all-reduced across them. A
``reduce_dtype`` (``--reduce-dtype bf16``) casts the gradients for both collectives, as
FSDP2's :class:`~torch.distributed.fsdp.MixedPrecisionPolicy` does; parameters stay fp32.

Checkpoints stay portable: the model's and the optimizer's *full* state dicts are gathered to
rank 0 in the plain ``torch.optim`` format (parameters by index), the same format an unsharded
or ZeRO-1 run writes, so any run can resume from any other, on any world size.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Optional, Sequence

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from hetfair.models.deferred_init import full_value, is_deferred

_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)  # full tensors, on rank 0 only
_LOAD_SHARDS = StateDictOptions(full_state_dict=False)  # each rank loads its own shards (sliced out of the full state)


def shard_model(model: nn.Module, units: Sequence[nn.Module], reshard_after_forward: bool,
                reduce_dtype: Optional[torch.dtype] = None, mesh: Optional[DeviceMesh] = None) -> None:
    """Shard ``units`` one by one, then ``model`` itself (in place), over ``mesh`` (default: all ranks);
    gradients are reduced in ``reduce_dtype`` (default: their own)."""
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for module in [*units, model]:
        fully_shard(module, reshard_after_forward=reshard_after_forward, mesh=mesh, mp_policy=policy)


def deferred_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The not yet materialised parameters and buffers of a deferred model (:mod:`hetfair.models.deferred_init`),
    by name; ``{}`` for a model built whole."""
    return {name: tensor for name, tensor in chain(model.named_parameters(), model.named_buffers())
            if is_deferred(tensor)}


def materialise_shards(model: nn.Module, sources: dict[str, torch.Tensor]) -> None:
    """Give a sharded meta model its values on the CPU: each tensor's full value (``sources``: the deferred
    tensors before sharding) is made once, this rank's shard copied out of it and the rest dropped, so the
    rank holds its shards and one full tensor at most; buffers (not sharded) are copied whole."""
    model.to_empty(device="cpu")  # allocates the local shards only
    with torch.no_grad():
        for name, tensor in chain(model.named_parameters(), model.named_buffers()):
            full = full_value(sources[name])
            if isinstance(tensor, DTensor):
                tensor.to_local().copy_(_own_slice(full, tensor))
            else:
                tensor.copy_(full)
            del full


def hybrid_mesh(device_type: str, layout: list[list[int]]) -> DeviceMesh:
    """The 2-D mesh of hybrid sharding: one row per node (``layout``: each node's ranks), replicated over the
    rows and sharded along each. A row's ranks need not be consecutive (``init_device_mesh`` assumes they are)."""
    return DeviceMesh(device_type, torch.tensor(layout), mesh_dim_names=("replicate", "shard"))


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
    """Load an unsharded model state (present on every rank); each rank keeps its shards.

    Each rank slices its own shard out of each full tensor, with no collective (torch's full-state loader
    scatters from rank 0, which reads every tensor whole): from a memory-mapped checkpoint
    (:func:`hetfair.checkpoint.layout.load_checkpoint`) a rank reads only the slices it keeps."""
    own = get_model_state_dict(model)
    set_model_state_dict(model, {name: _own_part(value, own.get(name)) for name, value in state.items()},
                         options=_LOAD_SHARDS)


def _own_part(value: Any, like: Any) -> Any:
    """This rank's shard of the full tensor ``value``, placed as the sharded tensor ``like``: a view of ``value``,
    nothing copied (anything else: as it is, for torch's loader to check)."""
    if not isinstance(like, DTensor) or not isinstance(value, torch.Tensor) or value.shape != like.shape:
        return value
    return DTensor.from_local(_own_slice(value.detach(), like), like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def _own_slice(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """The view of ``full`` that is this rank's local tensor of ``like``, found as torch's own full-state loader
    finds it (``distribute_tensor`` would copy it, or scatter it from rank 0)."""
    shape, offset = compute_local_shape_and_global_offset(full.shape, like.device_mesh, like.placements)
    return full[tuple(slice(start, start + size) for size, start in zip(shape, offset))]


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
    """Load a plain-format optimizer state (present on every rank); each rank slices its shards out of it, as
    :func:`load_full_model_state_dict` does."""
    if not state["state"]:
        # nothing to shard (plain SGD keeps no tensors), and torch's loader needs a tensor to find the device
        optimizer.load_state_dict(state)
        return
    names = _names(model, params)
    by_name = dict(model.named_parameters())
    fqn_state = {
        "state": {names[int(i)]: {key: _own_part(tensor, by_name[names[int(i)]]) for key, tensor in value.items()}
                  for i, value in state["state"].items()},
        "param_groups": [{**group, "params": [names[int(i)] for i in group["params"]]}
                         for group in state["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, fqn_state, options=_LOAD_SHARDS)


def _names(model: nn.Module, params: Sequence[nn.Parameter]) -> list[str]:
    """The fully qualified name of each of ``params``, in their order (the optimizer's indices), as state dicts
    name them (without an activation-checkpoint wrapper's part)."""
    by_id = {id(param): name.replace(_CHECKPOINT_PREFIX, "") for name, param in model.named_parameters()}
    return [by_id[id(param)] for param in params]

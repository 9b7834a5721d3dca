"""The whole model's and optimizer's state from a pipeline's stages, in the format every other mode writes.

Each stage holds its modules under the model's own names (:mod:`hetfair.parallel.pipeline_stage`),
so a stage's ``state_dict`` is a part of the whole model's. The master collects the parts of the
first pipeline's stages: which rank sends what follows from the split every rank knows, and the
tensors travel as tensors (point-to-point, in the order of the whole model's keys). The
optimizer's per-parameter state goes the same way, its keys and shapes first as JSON: nothing a
peer sends is unpickled. torch's distributed checkpoint does not write the plain
``torch.optim`` format other modes load, hence this module.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from hetfair.parallel.collectives import all_gather_json, comm_device
from hetfair.parallel.context import DistributedContext

Tensors = dict[str, torch.Tensor]


def gather_model_state(full_keys: Sequence[str], shapes: dict[str, tuple[torch.Size, torch.dtype]],
                       owners: dict[str, int], own: Tensors, context: DistributedContext) -> Tensors:
    """The whole state dict on the master (``{}`` elsewhere): key ``k`` (shape and dtype ``shapes[k]``) comes from
    rank ``owners[k]``, which holds it in ``own``. A collective of the owners and the master."""
    gathered: Tensors = {}
    for key in full_keys:
        value = _to_master(own.get(key), owners[key], *shapes[key], context)
        if value is not None:
            gathered[key] = value.to(_own_device(own))
    return gathered


def _to_master(tensor: Optional[torch.Tensor], owner: int, shape: Sequence[int], dtype: torch.dtype,
               context: DistributedContext) -> Optional[torch.Tensor]:
    """``tensor`` (held by rank ``owner``, of ``shape`` and ``dtype``) on the master, a copy; ``None`` elsewhere.
    Point-to-point from the owner, nothing where the master owns it."""
    if context.rank == owner:
        assert tensor is not None
        if context.is_master:
            return tensor.detach().clone()
        dist.send(tensor.detach().contiguous().to(comm_device(context)), dst=0)
    elif context.is_master:
        buffer = torch.empty(shape, dtype=dtype, device=comm_device(context))
        dist.recv(buffer, src=owner)
        return buffer
    return None


def _own_device(own: Tensors) -> torch.device:
    return next(iter(own.values())).device if own else torch.device("cpu")


def gather_optimizer_state(optimizer: torch.optim.Optimizer, full_index: Sequence[int], num_full: int,
                           sends: bool, context: DistributedContext) -> Optional[dict[str, Any]]:
    """The whole optimizer's plain ``state_dict`` on the master (``None`` elsewhere): this rank's optimizer holds
    the whole model's parameters ``full_index`` (in its own order) of ``num_full``; where ``sends`` (the first
    pipeline's ranks), it contributes their state, each parameter from the lowest rank that holds it."""
    local = optimizer.state_dict()
    header = {str(full_index[index]): _describe(state) for index, state in local["state"].items()} if sends else {}
    headers = all_gather_json(context, header)
    owners: dict[str, int] = {}
    for rank, described in enumerate(headers):
        for index in described:
            owners.setdefault(index, rank)
    state: dict[int, dict[str, Any]] = {}
    by_full = {str(full_index[index]): values for index, values in local["state"].items()}
    for index in sorted(owners, key=int):
        owner, described = owners[index], headers[owners[index]][index]
        entry: dict[str, Any] = {}
        for name, (kind, value) in described.items():
            if kind == "value":
                entry[name] = value
                continue
            shape, dtype = value
            tensor = _to_master(by_full.get(index, {}).get(name), owner, shape, getattr(torch, dtype), context)
            if tensor is not None:
                entry[name] = tensor
        state[int(index)] = entry
    if not context.is_master:
        return None
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": list(range(num_full))}
              for group in local["param_groups"][:1]]
    return {"state": state, "param_groups": groups}


def local_optimizer_state(full: dict[str, Any], full_index: Sequence[int]) -> dict[str, Any]:
    """This rank's part of a whole, plain optimizer ``state_dict`` (its parameters ``full_index``, in order)."""
    state = {local: full["state"][index] for local, index in enumerate(full_index) if index in full["state"]}
    group = {k: v for k, v in full["param_groups"][0].items() if k != "params"}
    return {"state": state, "param_groups": [{**group, "params": list(range(len(full_index)))}]}


def _describe(state: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    """A parameter's optimizer state as JSON: each tensor's shape and dtype, other values as they are."""
    return {name: ("tensor", [list(value.shape), str(value.dtype).removeprefix("torch.")])
            if isinstance(value, torch.Tensor) else ("value", value) for name, value in state.items()}

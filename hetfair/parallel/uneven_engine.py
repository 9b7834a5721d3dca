"""Uneven full sharding: each rank keeps its own fraction of every parameter, gathered unit by unit.

Rank ``r`` keeps the contiguous slice ``[b_r, b_{r+1})`` of each parameter's flattened
elements, ``b`` cut at the cumulative ``--shard-fractions`` (:func:`shard_bounds`). So each
rank's parameters, gradients and optimizer state are shards of the model's own tensors,
one to one: elementwise optimizers (SGD, Adam, AdamW: all of hetfair's) step shards
exactly as they step whole tensors, and the optimizer's parameter groups are the model's.

A *unit* (each of :meth:`~hetfair.models.HetfairModel.sharding_units`, then the rest of
the model) is gathered for its forward with ONE ``all_gather_into_tensor``: every rank
sends its slices of the unit's parameters as one segment, padded to the longest rank's
segment, and the gathered segments are copied into one parameter-major buffer whose
views the unit's modules compute with. In the backward the unit's gradients leave in ONE
``reduce_scatter_tensor`` (summed, the same padded layout), and each rank gets the sums of
its own slices. Both are raw collectives because torch's FSDP2 and DTensor shard only
evenly: ``Shard(0)`` placements cut with ``torch.chunk`` semantics, and uneven shards
are not planned (pytorch #144109: "arbitrary unevenness is very challenging").

Reshard after forward (the default; ``--no-reshard-after-forward`` opts out): a unit's
gathered buffer is freed when its forward ends. The tensors autograd saves from it are
stored as references (a ``torch.autograd.graph.saved_tensors_hooks`` pair), and the
unit is gathered again when the gradient of its output arrives (a multi-grad hook), so
every rank gathers the same units in the same order, with or without activation
checkpointing. The buffer is freed again once the unit's gradients are reduce-scattered.
The rest-of-model unit (the root: embeddings, heads) is not freed after its forward, as
in FSDP2: its forward encloses all others and its backward follows at once. A rank's peak
is therefore its state (shards of parameters, gradients and optimizer state) plus the
gathered root (from the start of the forward to the end of the backward), plus about one
gathered unit (two while one is copied or reduce-scattered), plus activations.

Offload (a ``storage_device`` of ``cpu`` beside a CUDA ``compute_device``): the shards,
their gradients and so the optimizer state live in host memory; a gather sends the shard
from there to the compute device, and the reduced gradient slices come back.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from hetfair.errors import ConfigError
from hetfair.models.deferred_init import full_value

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def shard_bounds(numel: int, fractions: Sequence[float]) -> list[int]:
    """Where each rank's slice of ``numel`` flat elements starts, and the end: rank ``r`` keeps
    ``[bounds[r], bounds[r + 1])``, about ``fractions[r] * numel`` elements (``fractions`` sum to 1)."""
    cuts = [min(numel, round(numel * total)) for total in itertools.accumulate(fractions[:-1])]
    return [0, *cuts, numel]


@dataclass
class ShardedParam:
    """One parameter of a unit: its full shape, every rank's slice of it, and this rank's shard."""

    name: str
    shape: torch.Size
    bounds: list[int]
    owners: list[tuple[nn.Module, str]]
    """Every module attribute that holds the parameter (tied parameters have several)."""
    shard: nn.Parameter

    @property
    def numel(self) -> int:
        return self.bounds[-1]

    def length(self, rank: int) -> int:
        return self.bounds[rank + 1] - self.bounds[rank]

    def install(self, tensor: torch.Tensor) -> None:
        """Make every owner compute with ``tensor`` (the gathered full value, or the shard at rest)."""
        for module, attr in self.owners:
            module._parameters[attr] = tensor  # type: ignore[assignment]  # a gathered view during forward


class ShardedUnit:
    """The parameters of one unit, each sliced over the ranks of the default group; gathers and scatters them."""

    def __init__(self, params: list[ShardedParam], rank: int, world_size: int, compute_device: torch.device,
                 reshard_after_forward: bool, reduce_dtype: Optional[torch.dtype]) -> None:
        self.params = params
        self.rank = rank
        self.world_size = world_size
        self.compute_device = compute_device
        self.reshard_after_forward = reshard_after_forward
        self.reduce_dtype = reduce_dtype
        lengths = [sum(p.length(r) for p in params) for r in range(world_size)]
        self.padded = max(lengths, default=0)
        """Every rank's segment is padded to the longest one (the collectives take equal chunks)."""
        self.numel = sum(p.numel for p in params)
        dtypes = {p.shard.dtype for p in params}
        if len(dtypes) > 1:
            raise ConfigError(f"a sharding unit mixes parameter dtypes {sorted(map(str, dtypes))} ({params[0].name}, "
                              f"...): give it parameters of one dtype, or --ddp-backend c10d")
        self.dtype = dtypes.pop() if dtypes else torch.float32
        self._flat: Optional[torch.Tensor] = None

    @property
    def full_bytes(self) -> int:
        """The bytes of the unit's gathered parameters."""
        return self.numel * self.dtype.itemsize

    @property
    def shards(self) -> list[nn.Parameter]:
        return [p.shard for p in self.params]

    # -- gather ------------------------------------------------------------------------------
    def gathered(self) -> torch.Tensor:
        """The unit's full parameters, one after another in one flat buffer (gathered if not held)."""
        if self._flat is None:
            self._flat = self._all_gather([p.shard.detach() for p in self.params])
        return self._flat

    def is_gathered(self) -> bool:
        return self._flat is not None

    def release(self) -> None:
        """Drop the gathered buffer (tensors still referring to it keep it alive until they go)."""
        self._flat = None

    def full_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's full value as a view of ``flat``."""
        starts = itertools.accumulate((p.numel for p in self.params), initial=0)
        return [flat[start:start + p.numel].view(p.shape) for start, p in zip(starts, self.params)]

    def gather_tensors(self, local: list[torch.Tensor]) -> list[torch.Tensor]:
        """The full tensors of which ``local`` are this rank's shards (one per parameter, same dtype): a collective."""
        return self.full_views(self._all_gather(local))

    def _all_gather(self, local: list[torch.Tensor]) -> torch.Tensor:
        dtype = local[0].dtype if local else self.dtype
        # the padding after a rank's slices is sent but never read: left as it is, not zeroed
        segment = torch.empty(self.padded, dtype=dtype, device=self.compute_device)
        mine = segment[:sum(t.numel() for t in local)]
        if local and local[0].device == segment.device:
            torch.cat([t.reshape(-1) for t in local], out=mine)
        elif local:  # offloaded shards: one copy to the compute device
            mine.copy_(torch.cat([t.reshape(-1) for t in local]))
        gathered = torch.empty(self.world_size * self.padded, dtype=dtype, device=self.compute_device)
        _ALL_GATHER(gathered, segment)
        by_rank = gathered.view(self.world_size, self.padded)
        flat = torch.empty(self.numel, dtype=dtype, device=self.compute_device)
        offsets = [0] * self.world_size
        start = 0
        for param in self.params:
            pieces = []
            for rank in range(self.world_size):
                length = param.length(rank)
                pieces.append(by_rank[rank, offsets[rank]:offsets[rank] + length])
                offsets[rank] += length
            torch.cat(pieces, out=flat[start:start + param.numel])
            start += param.numel
        return flat

    # -- reduce-scatter ----------------------------------------------------------------------------
    def reduce_scatter(self, grads: Sequence[Optional[torch.Tensor]]) -> list[torch.Tensor]:
        """Each rank's slices of the summed gradients ``grads`` (full, one per parameter; ``None``: zero),
        on the shards' device: a collective."""
        dtype = self.reduce_dtype or self.dtype
        # every slice is written (zeros for a parameter without a gradient); the padding is summed but never read
        send = torch.empty(self.world_size, self.padded, dtype=dtype, device=self.compute_device)
        offsets = [0] * self.world_size
        for param, grad in zip(self.params, grads):
            for rank in range(self.world_size):
                length = param.length(rank)
                if length:
                    into = send[rank, offsets[rank]:offsets[rank] + length]
                    if grad is None:
                        into.zero_()
                    else:
                        into.copy_(grad.reshape(-1)[param.bounds[rank]:param.bounds[rank + 1]])
                offsets[rank] += length
        mine = torch.empty(self.padded, dtype=dtype, device=self.compute_device)
        _REDUCE_SCATTER(mine, send.view(-1), op=dist.ReduceOp.SUM)
        del send
        mine = mine.to(device=self.params[0].shard.device, dtype=self.dtype) if self.params else mine
        starts = itertools.accumulate((p.length(self.rank) for p in self.params), initial=0)
        return [mine[start:start + p.length(self.rank)] for start, p in zip(starts, self.params)]


class _GatherUnit(torch.autograd.Function):
    """Shards in, the unit's full parameters out; the backward reduce-scatters their gradients to the shards."""

    @staticmethod
    def forward(ctx: Any, unit: ShardedUnit, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.unit = unit
        return tuple(unit.full_views(unit.gathered()))

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        unit: ShardedUnit = ctx.unit
        shard_grads = unit.reduce_scatter(grads)
        unit.release()
        return (None, *shard_grads)


@dataclass(frozen=True)
class _Regather:
    """A tensor autograd saved from a gathered unit, stored as where it lies in the unit's buffer."""

    unit: ShardedUnit
    offset: int
    size: torch.Size
    stride: tuple[int, ...]


class UnevenShardedModel:
    """Shards a model in place over the ranks (``fractions``) and gathers its units for compute."""

    def __init__(self, model: nn.Module, units: Sequence[nn.Module], fractions: Sequence[float], rank: int,
                 compute_device: torch.device, storage_device: torch.device, reshard_after_forward: bool,
                 reduce_dtype: Optional[torch.dtype]) -> None:
        self.model = model
        self.fractions = tuple(fractions)
        world_size = len(fractions)
        modules = [*units, model]
        groups = _assign_params(model, units)
        owners = _owners(model)
        self.units: list[ShardedUnit] = []
        self.param_of: dict[int, ShardedParam] = {}
        """Each shard's :class:`ShardedParam`, by ``id`` of the shard."""
        for module, named in zip(modules, groups):
            params = [self._shard(name, param, owners[id(param)], rank, storage_device) for name, param in named]
            # the root's backward starts as its forward ends: freeing it in between would only gather it again
            reshard = reshard_after_forward and module is not model
            unit = ShardedUnit(params, rank, world_size, compute_device, reshard, reduce_dtype)
            self.units.append(unit)
            if params:
                # a checkpoint wrapper recomputes its inner module's forward: the hooks gather for that one too
                computes = getattr(module, "_checkpoint_wrapped_module", module)
                computes.register_forward_pre_hook(self._before_forward(unit))
                computes.register_forward_hook(self._after_forward(unit), always_call=True)
        self._saved = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        model.register_forward_pre_hook(lambda *_: self._saved.__enter__(), prepend=True)
        model.register_forward_hook(lambda *_: self._saved.__exit__(None, None, None), always_call=True)

    def _shard(self, name: str, param: nn.Parameter, owners: list[tuple[nn.Module, str]], rank: int,
               device: torch.device) -> ShardedParam:
        full = full_value(param)
        bounds = shard_bounds(full.numel(), self.fractions)
        local = full.reshape(-1)[bounds[rank]:bounds[rank + 1]].to(device=device, copy=True)
        del full  # only this rank's slice stays
        sharded = ShardedParam(name, param.shape, bounds, owners, nn.Parameter(local, param.requires_grad))
        sharded.install(sharded.shard)
        self.param_of[id(sharded.shard)] = sharded
        return sharded

    # -- forward and backward --------------------------------------------------------------------
    def _before_forward(self, unit: ShardedUnit) -> Callable[..., None]:
        def hook(_module: nn.Module, _inputs: Any) -> None:
            if torch.is_grad_enabled() and any(s.requires_grad for s in unit.shards):
                fulls: Sequence[torch.Tensor] = _GatherUnit.apply(unit, *unit.shards)
            else:
                fulls = unit.full_views(unit.gathered())
            for param, full in zip(unit.params, fulls):
                param.install(full)
        return hook

    def _after_forward(self, unit: ShardedUnit) -> Callable[..., None]:
        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            for param in unit.params:
                param.install(param.shard)
            training = torch.is_grad_enabled() and any(s.requires_grad for s in unit.shards)
            if training and not unit.reshard_after_forward:
                return  # kept until its gradients are reduce-scattered
            unit.release()
            outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            if training and outputs:
                # at the start of the unit's backward, on every rank alike: gather it again
                torch.autograd.graph.register_multi_grad_hook(outputs, lambda _: unit.gathered(), mode="any")
        return hook

    def _pack(self, tensor: torch.Tensor) -> Any:
        key = _storage_key(tensor)
        for unit in self.units:
            if unit.is_gathered() and _storage_key(unit.gathered()) == key:
                return _Regather(unit, tensor.storage_offset(), tensor.size(), tensor.stride())
        return tensor

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        if isinstance(saved, _Regather):
            return saved.unit.gathered().as_strided(saved.size, saved.stride, saved.offset)
        return saved

    # -- whole tensors, for checkpoints ------------------------------------------------------------
    def full_state(self, is_master: bool) -> dict[int, torch.Tensor]:
        """Every parameter's full value on the CPU, by ``id`` of its shard, on the master (``{}`` elsewhere);
        gathered one unit at a time (a collective)."""
        full: dict[int, torch.Tensor] = {}
        for unit in self.units:
            if not unit.params:
                continue
            values = unit.gather_tensors([p.shard.detach() for p in unit.params])
            if is_master:
                full.update((id(p.shard), value.cpu().clone()) for p, value in zip(unit.params, values))
        return full


def gather_param(param: ShardedParam, local: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The full tensor of which ``local`` is this rank's slice of ``param`` (an optimizer state, say), on the CPU:
    one padded all-gather on ``device``."""
    world_size = len(param.bounds) - 1
    padded = max(param.length(rank) for rank in range(world_size))
    segment = torch.zeros(padded, dtype=local.dtype, device=device)
    segment[:local.numel()] = local.to(device)
    gathered = torch.empty(world_size, padded, dtype=local.dtype, device=device)
    _ALL_GATHER(gathered.view(-1), segment)
    return torch.cat([gathered[rank, :param.length(rank)] for rank in range(world_size)]).view(param.shape).cpu()


def _storage_key(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, a tracing fake)
        return -1


def _assign_params(model: nn.Module, units: Sequence[nn.Module]) -> list[list[tuple[str, nn.Parameter]]]:
    """The parameters of each unit, then of the rest, by name; one held by several units goes to the rest."""
    unit_of: dict[int, int] = {}
    for index, unit in enumerate(units):
        for param in unit.parameters():
            unit_of[id(param)] = index if unit_of.get(id(param), index) == index else len(units)
    groups: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(len(units) + 1)]
    for name, param in model.named_parameters():
        groups[unit_of.get(id(param), len(units))].append((name, param))
    return groups


def _owners(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every (module, attribute) holding each parameter, by ``id`` of the parameter."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None and (module, attr) not in owners.setdefault(id(param), []):
                owners[id(param)].append((module, attr))
    return owners

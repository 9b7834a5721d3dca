"""Uneven full sharding: each rank keeps its own fraction of every parameter, gathered unit by unit.

Rank ``r`` keeps the contiguous slice ``[b_r, b_{r+1})`` of each parameter's flattened
elements, ``b`` cut at the cumulative ``--shard-fractions`` (:func:`shard_bounds`). So each
rank's parameters, gradients and optimizer state are shards of the model's own tensors,
one to one: elementwise optimizers (SGD, Adam, AdamW: all of hetfair's) step shards
exactly as they step whole tensors, and the optimizer's parameter groups are the model's.

A *unit* (each of :meth:`~hetfair.models.HetfairModel.sharding_units`, then the rest of
the model) is gathered for its forward with ONE collective into one parameter-major
buffer whose views the unit's modules compute with, and its gradients leave in ONE
collective in the backward, each rank getting the sums of its own slices
(:mod:`hetfair.parallel.uneven_collectives`: padded all-gather and reduce-scatter on NCCL;
on gloo the reduction is an all-reduce, and the gather whichever of the two a start-up probe
times faster). These are raw collectives because torch's FSDP2 and DTensor shard only
evenly: ``Shard(0)`` placements cut with ``torch.chunk`` semantics, and uneven shards
are not planned (pytorch #144109: "arbitrary unevenness is very challenging").

**Prefetch and overlap**, as FSDP2 does: the units run in the order the last forward ran
them; when a unit's forward starts, the next unit's gather starts (async); when a unit's
backward starts, the gather of the unit before it starts; a unit's gradient reduction starts
when its backward ends and completes while the units before it run theirs, its sums
accumulated into the shards' ``.grad`` (and their post-accumulate-grad hooks called, as
autograd would) when it is done, at the latest when the backward ends (an autograd final
callback). At most one gather is started ahead and one reduction is in flight.

Reshard after forward (the default; ``--no-reshard-after-forward`` opts out): a unit's
gathered buffer is freed when its forward ends. The tensors autograd saves from it are
stored as references (a ``torch.autograd.graph.saved_tensors_hooks`` pair), and the
unit is gathered again when the gradient of its output arrives (a multi-grad hook), so
every rank gathers the same units in the same order, with or without activation
checkpointing. The buffer is freed again once the unit's gradients leave.
The rest-of-model unit (the root: embeddings, heads) is not freed after its forward, as
in FSDP2: its forward encloses all others and its backward follows at once. A rank's peak
is therefore its state (shards of parameters, gradients and optimizer state) plus the
gathered root (from the start of the forward to the end of the backward), plus two
gathered units (the one computing and the one prefetched) and one unit's gradients in
flight, plus activations.

Offload (a ``storage_device`` of ``cpu`` beside a CUDA ``compute_device``): the shards,
their gradients and so the optimizer state live in host memory; a gather sends the shard
from there to the compute device, and the reduced gradient slices come back.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from hetfair.errors import ConfigError
from hetfair.models.deferred_init import full_value
from hetfair.parallel.uneven_collectives import (
    PROBE_ELEMENTS,
    Gather,
    InFlight,
    Reduce,
    UnitSlices,
    faster_gather,
    gather_padded,
    reduce_padded,
    reduce_summed,
)

REDUCTIONS_IN_FLIGHT = 1
"""Units whose gradients may still be travelling when the next unit's start: each holds a unit's gradients."""


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
    """The parameters of one unit, each sliced over the ranks of the default group; gathers and reduces them."""

    def __init__(self, params: list[ShardedParam], rank: int, compute_device: torch.device,
                 reshard_after_forward: bool, reduce_dtype: Optional[torch.dtype], gather: Gather,
                 reduce: Reduce) -> None:
        self.params = params
        self.rank = rank
        self.compute_device = compute_device
        self.reshard_after_forward = reshard_after_forward
        self.reduce_dtype = reduce_dtype
        self.slices = UnitSlices(tuple(p.numel for p in params), tuple(tuple(p.bounds) for p in params), rank)
        self.gather_method = gather
        self.reduce_method = reduce
        dtypes = {p.shard.dtype for p in params}
        if len(dtypes) > 1:
            raise ConfigError(f"a sharding unit mixes parameter dtypes {sorted(map(str, dtypes))} ({params[0].name}, "
                              f"...): give it parameters of one dtype, or --ddp-backend c10d")
        self.dtype = dtypes.pop() if dtypes else torch.float32
        self._flat: Optional[torch.Tensor] = None
        self._gathering: Optional[InFlight[torch.Tensor]] = None

    @property
    def numel(self) -> int:
        return self.slices.numel

    @property
    def full_bytes(self) -> int:
        """The bytes of the unit's gathered parameters."""
        return self.numel * self.dtype.itemsize

    @property
    def shards(self) -> list[nn.Parameter]:
        return [p.shard for p in self.params]

    # -- gather ------------------------------------------------------------------------------
    def start_gather(self) -> None:
        """Start gathering the unit's full parameters, unless they are held or on their way (a collective)."""
        if self._flat is None and self._gathering is None:
            self._gathering = self.gather_method(self.slices, [p.shard.detach() for p in self.params], self.dtype,
                                                 self.compute_device)

    def gathered(self) -> torch.Tensor:
        """The unit's full parameters, one after another in one flat buffer (gathered if not held)."""
        if self._flat is None:
            self.start_gather()
            assert self._gathering is not None
            self._flat, self._gathering = self._gathering.wait(), None
        return self._flat

    def is_gathered(self) -> bool:
        return self._flat is not None

    def release(self) -> None:
        """Drop the gathered buffer (tensors still referring to it keep it alive until they go)."""
        self._flat = None

    def finish_unused_gather(self) -> None:
        """Finish and drop a gather started for nothing (a prefetch of a unit that did not run after all)."""
        if self._gathering is not None:
            self._gathering.wait()
            self._gathering = None

    def full_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's full value as a view of ``flat``."""
        return [flat[start:start + p.numel].view(p.shape) for start, p in zip(self.slices.starts, self.params)]

    def gather_tensors(self, local: list[torch.Tensor]) -> list[torch.Tensor]:
        """The full tensors of which ``local`` are this rank's shards (one per parameter, same dtype): a collective."""
        dtype = local[0].dtype if local else self.dtype
        return self.full_views(self.gather_method(self.slices, local, dtype, self.compute_device).wait())

    # -- reduce ------------------------------------------------------------------------------------
    def start_reduce(self, grads: Sequence[Optional[torch.Tensor]]) -> InFlight[list[torch.Tensor]]:
        """Start summing the full gradients ``grads`` (one per parameter; ``None``: zero) over the ranks; the result
        is this rank's slice of each, on the shards' device (a collective)."""
        travelling = self.reduce_method(self.slices, grads, self.reduce_dtype or self.dtype, self.compute_device)

        def finish() -> list[torch.Tensor]:
            mine = travelling.wait()
            mine = mine.to(device=self.params[0].shard.device, dtype=self.dtype) if self.params else mine
            starts = itertools.accumulate((p.length(self.rank) for p in self.params), initial=0)
            return [mine[start:start + p.length(self.rank)] for start, p in zip(starts, self.params)]

        return InFlight(None, finish)


class _GatherUnit(torch.autograd.Function):
    """The unit's full parameters out; the backward sends their gradients on their way to the shards.

    Its one input is the engine's anchor, an empty tensor that requires a gradient, not the shards: autograd would
    run the shards' post-accumulate-grad hooks at the end of the unit's backward, before their gradients arrive
    (the engine runs them when they do)."""

    @staticmethod
    def forward(ctx: Any, engine: "UnevenShardedModel", unit: ShardedUnit,  # type: ignore[override]
                _anchor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.engine, ctx.unit = engine, unit
        return tuple(unit.full_views(unit.gathered()))

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        unit: ShardedUnit = ctx.unit
        ctx.engine.reduce_later(unit, grads)
        unit.release()
        return None, None, None


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
        modules = [*units, model]
        groups = _assign_params(model, units)
        owners = _owners(model)
        # gloo (CPU tensors): reductions by all-reduce (its reduce-scatter is a padded all-reduce), gathers timed below
        summed = compute_device.type == "cpu"
        reduce = reduce_summed if summed else reduce_padded
        self.units: list[ShardedUnit] = []
        self.param_of: dict[int, ShardedParam] = {}
        """Each shard's :class:`ShardedParam`, by ``id`` of the shard."""
        for module, named in zip(modules, groups):
            params = [self._shard(name, param, owners[id(param)], rank, storage_device) for name, param in named]
            # the root's backward starts as its forward ends: freeing it in between would only gather it again
            reshard = reshard_after_forward and module is not model
            unit = ShardedUnit(params, rank, compute_device, reshard, reduce_dtype, gather_padded, reduce)
            self.units.append(unit)
            if params:
                # a checkpoint wrapper recomputes its inner module's forward: the hooks gather for that one too
                computes = getattr(module, "_checkpoint_wrapped_module", module)
                computes.register_forward_pre_hook(self._before_forward(unit))
                computes.register_forward_hook(self._after_forward(unit), always_call=True)
        self.gather_seconds: dict[str, float] = {}
        """The start-up probe's seconds of each gather (gloo; empty where padded gathers are the only choice)."""
        self.probe_elements = 0
        """The elements of the probe's unit (0: no probe)."""
        if summed:
            largest = max((unit.numel for unit in self.units), default=0)
            self.probe_elements = max(min(largest, PROBE_ELEMENTS), len(fractions))
            gather, self.gather_seconds = faster_gather(shard_bounds(self.probe_elements, fractions), rank,
                                                        compute_device)
            for unit in self.units:
                unit.gather_method = gather
        self._ran: list[ShardedUnit] = []
        """The units in the order the last forward ran them."""
        self._place: dict[int, int] = {}
        """Each unit's place in :attr:`_ran`, by ``id``."""
        self._running: Optional[list[ShardedUnit]] = None  # the units this forward has run (None: no forward)
        self._reductions: deque[tuple[ShardedUnit, InFlight[list[torch.Tensor]]]] = deque()
        self._callback_queued = False
        self._anchor = torch.empty(0, requires_grad=True)
        self._saved = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        model.register_forward_pre_hook(self._forward_starts, prepend=True)
        model.register_forward_hook(self._forward_ends, always_call=True)

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

    @property
    def gather_name(self) -> str:
        """How units are gathered: ``all-reduce`` or ``padded all-gather``."""
        return min(self.gather_seconds, key=self.gather_seconds.__getitem__) if self.gather_seconds \
            else "padded all-gather"

    # -- forward and backward --------------------------------------------------------------------
    def _forward_starts(self, *_: Any) -> None:
        self._settle()  # a forward after an interrupted backward starts from nothing in flight
        self._saved.__enter__()
        self._running = []

    def _forward_ends(self, *_: Any) -> None:
        self._saved.__exit__(None, None, None)
        if self._running is None:
            return
        self._ran, self._running = self._running, None
        self._place = {id(unit): place for place, unit in enumerate(self._ran)}
        if not torch.is_grad_enabled():  # no backward follows: a prefetch nothing used is finished here
            for unit in self.units:
                unit.finish_unused_gather()
        elif self._ran:  # the last unit to run forward is the first to run backward
            self._ran[-1].start_gather()

    def _prefetch(self, unit: ShardedUnit, step: int) -> None:
        """Start gathering the unit ``step`` places after ``unit`` in the last forward's order, if any."""
        place = self._place.get(id(unit))
        if place is not None and 0 <= place + step < len(self._ran):
            self._ran[place + step].start_gather()

    def _before_forward(self, unit: ShardedUnit) -> Callable[..., None]:
        def hook(_module: nn.Module, _inputs: Any) -> None:
            if torch.is_grad_enabled() and any(s.requires_grad for s in unit.shards):
                fulls: Sequence[torch.Tensor] = _GatherUnit.apply(self, unit, self._anchor)
            else:
                fulls = unit.full_views(unit.gathered())
            for param, full in zip(unit.params, fulls):
                param.install(full)
            if self._running is not None:  # the model's forward, not a recomputation in the backward
                self._running.append(unit)
                self._prefetch(unit, +1)
        return hook

    def _after_forward(self, unit: ShardedUnit) -> Callable[..., None]:
        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            for param in unit.params:
                param.install(param.shard)
            training = torch.is_grad_enabled() and any(s.requires_grad for s in unit.shards)
            if training and not unit.reshard_after_forward:
                return  # kept until its gradients leave
            unit.release()
            outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            if training and outputs:
                # at the start of the unit's backward, on every rank alike: gather it again, and the next one ahead
                torch.autograd.graph.register_multi_grad_hook(outputs, lambda _: self._backward_starts(unit),
                                                              mode="any")
        return hook

    def _backward_starts(self, unit: ShardedUnit) -> None:
        unit.gathered()
        self._prefetch(unit, -1)

    def reduce_later(self, unit: ShardedUnit, grads: Sequence[Optional[torch.Tensor]]) -> None:
        """Start reducing ``unit``'s gradients ``grads``; finish the oldest reductions beyond the bound, and all of
        them when the backward ends."""
        while len(self._reductions) >= REDUCTIONS_IN_FLIGHT:
            self._accumulate(*self._reductions.popleft())
        self._reductions.append((unit, unit.start_reduce(grads)))
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._settle)

    def _settle(self) -> None:
        """Finish every reduction in flight and every gather nothing used (a collective, the same on every rank)."""
        while self._reductions:
            self._accumulate(*self._reductions.popleft())
        for unit in self.units:
            unit.finish_unused_gather()
        self._callback_queued = False

    @staticmethod
    def _accumulate(unit: ShardedUnit, travelling: InFlight[list[torch.Tensor]]) -> None:
        """Add a finished reduction's slices to the shards' gradients, as autograd would have (hooks included:
        FSDP2 calls them too)."""
        for param, grad in zip(unit.params, travelling.wait()):
            shard = param.shard
            if not shard.requires_grad:
                continue
            if shard.grad is None:
                shard.grad = grad
            else:
                shard.grad.add_(grad)
            for hook in (getattr(shard, "_post_accumulate_grad_hooks", None) or {}).values():
                hook(shard)

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
    slices = UnitSlices((param.numel,), (tuple(param.bounds),), dist.get_rank())
    return gather_padded(slices, [local.to(device)], local.dtype, device).wait().view(param.shape).cpu()


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

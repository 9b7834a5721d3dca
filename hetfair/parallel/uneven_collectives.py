"""How the uneven engine moves one unit's parameters and gradients between ranks: two layouts, started async.

A unit's parameters are flattened one after another (parameter-major) into one buffer of
``numel`` elements; rank ``r`` holds the slice ``[bounds[r], bounds[r + 1])`` of each.

* **Padded** (``all_gather_into_tensor`` / ``reduce_scatter_tensor``): each rank's slices
  travel as one segment, padded to the longest rank's, because those collectives take equal
  chunks; a gather is followed by a copy from the rank-major segments into the parameter-major
  buffer. At shares 1:3 each moves 1.5x what even shares move. NCCL runs these (its uneven
  collectives are not used: untested here, no GPU in CI).
* **Summed** (one ``all_reduce`` of the parameter-major buffer): a gather writes this rank's
  slices into zeros and sums them (adding zeros is exact); a reduction sums the whole gradients
  and keeps this rank's slices. Nothing is padded or reordered. gloo's ``reduce_scatter_tensor``
  is an all-reduce of its whole input (every rank's padded segment: at least the unit), so
  the summed reduction is never slower there (measured at 1:3, 32 MB: 0.05 s against 0.16 s);
  its gather sends ``2 (W - 1) / W`` of the unit against the padded ``(W - 1)`` longest
  segments, so which gather is faster depends on the link and the CPU: :func:`faster_gather`
  times both.

Every collective starts with ``async_op=True`` and comes back as an :class:`InFlight`, whose
``wait()`` returns the result: the engine starts the next unit's gather while this one computes.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Generic, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

T = TypeVar("T")


@dataclass
class InFlight(Generic[T]):
    """A collective started asynchronously; :meth:`wait` blocks until it is done and returns its result."""

    work: Optional[dist.Work]
    finish: Callable[[], T]

    def wait(self) -> T:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.finish()


@dataclass(frozen=True)
class UnitSlices:
    """The sizes of a unit's parameters and every rank's slice of each (``bounds[p][r]``, see ``shard_bounds``)."""

    numels: tuple[int, ...]
    bounds: tuple[tuple[int, ...], ...]
    rank: int

    @property
    def world_size(self) -> int:
        return len(self.bounds[0]) - 1 if self.bounds else 1

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @cached_property
    def starts(self) -> tuple[int, ...]:
        """Where each parameter starts in the unit's flat buffer."""
        return tuple(itertools.accumulate(self.numels, initial=0))[:-1]

    def length(self, rank: int) -> int:
        """Elements of rank ``rank``'s segment (its slices of every parameter)."""
        return sum(b[rank + 1] - b[rank] for b in self.bounds)

    @cached_property
    def padded(self) -> int:
        """The longest rank's segment: the chunk every rank sends in the padded layout."""
        return max((self.length(rank) for rank in range(self.world_size)), default=0)

    def mine(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """This rank's slice of each parameter, as views of the unit's flat buffer ``flat``."""
        r = self.rank
        return [flat[start + b[r]:start + b[r + 1]] for start, b in zip(self.starts, self.bounds)]


# -- gathers: this rank's slices in, the unit's flat buffer out -----------------------------------
def gather_summed(slices: UnitSlices, local: Sequence[torch.Tensor], dtype: torch.dtype,
                  device: torch.device) -> InFlight[torch.Tensor]:
    """Start gathering the unit by one all-reduce of its buffer, zeros but for this rank's slices."""
    flat = torch.zeros(slices.numel, dtype=dtype, device=device)
    for view, tensor in zip(slices.mine(flat), local):
        view.copy_(tensor.reshape(-1))
    return InFlight(dist.all_reduce(flat, async_op=True), lambda: flat)


def gather_padded(slices: UnitSlices, local: Sequence[torch.Tensor], dtype: torch.dtype,
                  device: torch.device) -> InFlight[torch.Tensor]:
    """Start gathering the unit by one all-gather of every rank's segment, padded to the longest."""
    world, padded = slices.world_size, slices.padded
    # the padding after a rank's slices is sent but never read: left as it is, not zeroed
    segment = torch.empty(padded, dtype=dtype, device=device)
    if local:
        torch.cat([t.reshape(-1).to(device) for t in local], out=segment[:sum(t.numel() for t in local)])
    gathered = torch.empty(world * padded, dtype=dtype, device=device)
    work = _ALL_GATHER(gathered, segment, async_op=True)

    def finish(_sent: torch.Tensor = segment) -> torch.Tensor:  # holds the segment until the gather is done
        by_rank = gathered.view(world, padded)
        flat = torch.empty(slices.numel, dtype=dtype, device=device)
        offsets = [0] * world
        for start, numel, bounds in zip(slices.starts, slices.numels, slices.bounds):
            pieces = []
            for rank in range(world):
                length = bounds[rank + 1] - bounds[rank]
                pieces.append(by_rank[rank, offsets[rank]:offsets[rank] + length])
                offsets[rank] += length
            torch.cat(pieces, out=flat[start:start + numel])
        return flat

    return InFlight(work, finish)


# -- reductions: the full gradients in, the sums of this rank's slices out -----------------------------
def reduce_summed(slices: UnitSlices, grads: Sequence[Optional[torch.Tensor]], dtype: torch.dtype,
                  device: torch.device) -> InFlight[torch.Tensor]:
    """Start summing the unit's gradients (``None``: zero) over the ranks by one all-reduce; the result is this
    rank's segment."""
    flat = torch.empty(slices.numel, dtype=dtype, device=device)
    for start, numel, grad in zip(slices.starts, slices.numels, grads):
        into = flat[start:start + numel]
        if grad is None:
            into.zero_()
        else:
            into.copy_(grad.reshape(-1))
    mine = slices.mine
    return InFlight(dist.all_reduce(flat, async_op=True), lambda: torch.cat(mine(flat)))


def reduce_padded(slices: UnitSlices, grads: Sequence[Optional[torch.Tensor]], dtype: torch.dtype,
                  device: torch.device) -> InFlight[torch.Tensor]:
    """Start summing the unit's gradients over the ranks by one reduce-scatter of padded segments; the result is
    this rank's segment."""
    world, padded = slices.world_size, slices.padded
    # every slice is written (zeros for a parameter without a gradient); the padding is summed but never read
    send = torch.empty(world, padded, dtype=dtype, device=device)
    offsets = [0] * world
    for grad, bounds in zip(grads, slices.bounds):
        for rank in range(world):
            length = bounds[rank + 1] - bounds[rank]
            if length:
                into = send[rank, offsets[rank]:offsets[rank] + length]
                if grad is None:
                    into.zero_()
                else:
                    into.copy_(grad.reshape(-1)[bounds[rank]:bounds[rank + 1]])
            offsets[rank] += length
    received = torch.empty(padded, dtype=dtype, device=device)
    work = _REDUCE_SCATTER(received, send.view(-1), op=dist.ReduceOp.SUM, async_op=True)

    def finish(_sent: torch.Tensor = send) -> torch.Tensor:  # holds the send buffer until the reduction is done
        return received[:slices.length(slices.rank)]

    return InFlight(work, finish)


Gather = Callable[[UnitSlices, Sequence[torch.Tensor], torch.dtype, torch.device], InFlight[torch.Tensor]]
Reduce = Callable[[UnitSlices, Sequence[Optional[torch.Tensor]], torch.dtype, torch.device], InFlight[torch.Tensor]]

PROBE_ELEMENTS = 1 << 20
"""The probe's unit: 4 MB of fp32, at most the largest unit (long enough to time, short enough to be cheap)."""


def faster_gather(bounds: Sequence[int], rank: int, device: torch.device) -> tuple[Gather, dict[str, float]]:
    """The faster gather of a one-parameter fp32 unit cut at ``bounds`` (every rank's slice, as the engine cuts),
    timed on every rank (one untimed, then the median of three) and agreed by the slowest rank's time: a collective.
    Also each gather's seconds, by name."""
    slices = UnitSlices((bounds[-1],), (tuple(bounds),), rank)
    local = [torch.ones(bounds[rank + 1] - bounds[rank], device=device)]
    methods: dict[str, Gather] = {"all-reduce": gather_summed, "padded all-gather": gather_padded}
    seconds = []
    for method in methods.values():
        method(slices, local, torch.float32, device).wait()
        timed = []
        for _ in range(3):
            start = time.perf_counter()
            method(slices, local, torch.float32, device).wait()
            timed.append(time.perf_counter() - start)
        seconds.append(sorted(timed)[1])
    slowest = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    times = dict(zip(methods, slowest.tolist()))
    return methods[min(times, key=times.__getitem__)], times

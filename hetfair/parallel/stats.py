"""Summing logging stats across ranks: one all-reduce when possible (fast-stat-sync).

Every summable value (and the per-rank slots used for throughput, where each
rank fills only its own slot) is packed into one float64 vector. Two extra
slots let all ranks agree, from the same reduced vector, whether that was
valid: a fingerprint of the key set (identical keys on all ranks sum to
``world_size * fingerprint``) and a count of ranks holding values that cannot
be summed. If either check fails, every rank falls back to gathering every rank's logs as
JSON in a byte tensor (never pickled objects: no rank unpickles what a peer sends).
Criteria must therefore log the same keys for every batch (the trainer logs
zeros under the same keys for a rank without data).

Other values every rank sums at each update (the preemption vote) can ride in the
same vector (:class:`Rider`), which saves them a collective of their own.

The vector itself may ride the gradients' all-reduce (:class:`StatsCarrier`: DDP's first bucket on
gloo, :mod:`hetfair.parallel.gradient_comm`), in float32. Counts are exact there below 2**24 (each
rank checks that its own are below ``2**24 / world_size`` and says so in one more slot); the other
sums (losses, seconds) keep float32's precision. Where a rank's counts are too large, or the
gradients' all-reduce did not run, every rank sums the float64 vector in a collective of its own.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from numbers import Number
from typing import Any, Mapping, Optional, Protocol

import torch
import torch.distributed as dist

from hetfair.parallel.collectives import all_gather_json, comm_device
from hetfair.parallel.context import DistributedContext


def is_summable(value: Any) -> bool:
    """Numbers (and one-element tensors) can be summed across batches and ranks; anything else cannot."""
    return type(value) is float or isinstance(value, (Number, torch.Tensor))  # float first: no ABC check


def sum_logs(totals: dict[str, float], logs: Mapping[str, Any]) -> dict[str, float]:
    """Add the summable values of ``logs`` into ``totals`` (in place; returned); other values are skipped.

    The one way logging outputs are summed: over micro-batches, updates, batches and ranks.
    """
    for key, value in logs.items():
        if is_summable(value):
            totals[key] = totals.get(key, 0.0) + float(value)
    return totals


@dataclass
class UpdateResult:
    """What one update reports, identical on every rank after the stats all-reduce."""

    totals: dict[str, Any]
    """The criterion's logs (and ``sample_size``) summed over ranks and micro-batches."""
    samples: list[float]
    """Samples each rank trained on in this update, indexed by rank."""
    timed_samples: list[float]
    """Samples each rank trained on in the *previous* update (empty on a trainer's first update): those of
    :attr:`compute_seconds`."""
    compute_seconds: list[float]
    """Each rank's own forward/backward seconds of the previous update (waiting for peers excluded), indexed
    by rank; empty with :attr:`timed_samples`. The stats leave before this update's last backward, so its
    timings travel with the next."""
    lr: float
    gnorm: float
    clipped: bool
    skipped: bool = False
    """The gradients overflowed: the update was not applied (fp16 loss scaling)."""
    loss_scale: Optional[float] = None
    """The job's loss scale after this update (``None``: no rank runs fp16)."""


@dataclass
class SyncedStats:
    """Stats summed over ranks (non-summable values: lists over ranks), plus per-rank values and the riders' sums."""

    totals: dict[str, Any]
    per_rank: dict[str, list[float]]
    riders: dict[str, float] = field(default_factory=dict)


class StatsCarrier(Protocol):
    """A gradient all-reduce that can carry the stats vector: no collective of its own for the stats."""

    def carry(self, vector: torch.Tensor) -> bool:
        """Send float32 ``vector`` with the next gradient all-reduce (the same answer on every rank); False:
        send it yourself."""

    def carried(self) -> Optional[torch.Tensor]:
        """The carried vector summed over ranks, once that all-reduce completed (``None``: it did not run)."""


class Rider(Protocol):
    """Numbers every rank sums at every update, sent with the update's stats instead of in a collective of their own."""

    def ride(self) -> dict[str, float]:
        """This rank's values (the same keys on every rank), read when the stats leave."""

    def arrive(self, sums: dict[str, float]) -> None:
        """Every rank's values summed, when the stats are back (the same on every rank)."""


@lru_cache(maxsize=64)
def _fingerprint(keys: tuple[str, ...]) -> float:
    """A number for the key set; below 2**16, so ``world_size`` times it is exact in float32."""
    return float(zlib.crc32("\0".join(keys).encode()) & 0xFFFF)


EXACT_IN_FLOAT32 = 2.0 ** 24
"""Whole numbers up to this are exact in float32, and so is their sum while it stays below."""


def sync_stats(
    context: DistributedContext, totals: dict[str, Any], per_rank: dict[str, float]
) -> SyncedStats:
    """Sum ``totals`` over ranks and gather each rank's ``per_rank`` values."""
    return start_sync_stats(context, totals, per_rank).wait()


def start_sync_stats(
    context: DistributedContext, totals: dict[str, Any], per_rank: dict[str, float],
    riders: Optional[Mapping[str, float]] = None, carrier: Optional[StatsCarrier] = None,
) -> "PendingStats":
    """Start :func:`sync_stats`'s all-reduce without waiting for it (``async_op``); :meth:`PendingStats.wait` ends it.

    Work issued in between (a backward pass, DDP's gradient all-reduce) overlaps the
    stats' round trip. Every rank must start it at the same point of its collectives.
    ``riders``: more numbers to sum over ranks (:class:`Rider` values), returned apart from the stats.
    ``carrier``: the gradient all-reduce of the backward that follows, which may carry the vector.
    """
    return PendingStats(context, totals, per_rank, dict(riders or {}), carrier)


class PendingStats:
    """A stats all-reduce in flight; :meth:`wait` returns its :class:`SyncedStats`.

    The vector: the summable ``totals``, one slot per rank of each ``per_rank`` value,
    the ``riders``, the count of ranks whose counts float32 cannot sum exactly, the key set's
    fingerprint and the count of ranks whose totals cannot be summed.
    """

    def __init__(self, context: DistributedContext, totals: dict[str, Any], per_rank: dict[str, float],
                 riders: Optional[dict[str, float]] = None, carrier: Optional[StatsCarrier] = None) -> None:
        self._context, self._totals, self._per_rank = context, totals, per_rank
        self._riders = riders or {}
        self._carrier: Optional[StatsCarrier] = None
        if not context.is_distributed:
            return
        world = context.world_size
        self._keys, self._rank_keys, self._rider_keys = sorted(totals), sorted(per_rank), sorted(self._riders)
        summable = all(is_summable(totals[k]) for k in self._keys)
        size = len(self._keys) + len(self._rank_keys) * world + len(self._rider_keys) + 3
        self._fingerprint = _fingerprint((*self._keys, "|", *self._rank_keys, "|", *self._rider_keys, str(size)))
        local = [0.0] * size
        if summable:
            local[: len(self._keys)] = [float(totals[k]) for k in self._keys]
        for i, key in enumerate(self._rank_keys):
            local[len(self._keys) + i * world + context.rank] = float(per_rank[key])
        local[size - 3 - len(self._rider_keys): size - 3] = [float(self._riders[k]) for k in self._rider_keys]
        local[-3] = 0.0 if _exact_in_float32(local, world) else 1.0
        local[-2] = self._fingerprint
        local[-1] = 0.0 if summable else 1.0
        self._buffer = torch.tensor(local, dtype=torch.float64, device=comm_device(context))
        if carrier is not None and carrier.carry(self._buffer.float()):
            self._carrier = carrier
        else:
            self._work = dist.all_reduce(self._buffer, async_op=True)

    def wait(self) -> SyncedStats:
        """Wait for the all-reduce (or, when some rank's values cannot be summed, gather them all as JSON)."""
        context, totals, per_rank = self._context, self._totals, self._per_rank
        if not context.is_distributed:
            return SyncedStats(dict(totals), {k: [float(v)] for k, v in per_rank.items()}, dict(self._riders))
        values, world, keys = self._summed(), context.world_size, self._keys
        if values[-1] == 0 and values[-2] == world * self._fingerprint:
            rider_values = values[len(values) - 3 - len(self._rider_keys): -3]
            return SyncedStats(
                totals=dict(zip(keys, values[: len(keys)])),
                per_rank={key: values[len(keys) + i * world: len(keys) + (i + 1) * world]
                          for i, key in enumerate(self._rank_keys)},
                riders=dict(zip(self._rider_keys, rider_values)),
            )
        return _gather_json(context, totals, per_rank, self._riders)

    def _summed(self) -> list[float]:
        """The vector summed over ranks: as carried, or (where it was not, or its counts are not exact in float32 on
        some rank, or the carrying all-reduce did not run: the same on every rank) by an all-reduce of its own."""
        if self._carrier is not None:
            carried = self._carrier.carried()
            if carried is not None and carried[-3].item() == 0:
                return carried.tolist()
            self._work = dist.all_reduce(self._buffer, async_op=True)
        self._work.wait()
        return self._buffer.tolist()


def _exact_in_float32(values: list[float], world_size: int) -> bool:
    """Whether float32 sums this rank's whole numbers exactly, whatever the other ranks send: each below
    ``2**24 / world_size`` (fractions, the logs' sums and the seconds, keep float32's precision)."""
    limit = EXACT_IN_FLOAT32 / world_size
    return all(abs(value) < limit for value in values if math.isfinite(value) and value == int(value))


def _plain(value: Any) -> Any:
    """A one-element tensor as its number, so that it travels as JSON."""
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


def _gather_json(context: DistributedContext, totals: dict[str, Any], per_rank: dict[str, float],
                 riders: dict[str, float]) -> SyncedStats:
    gathered = all_gather_json(context, [{k: _plain(v) for k, v in totals.items()}, per_rank, riders])
    merged: dict[str, Any] = {}
    for rank_totals, _, _ in gathered:
        sum_logs(merged, rank_totals)
        for key, value in rank_totals.items():
            if not is_summable(value):  # values that cannot be summed are collected, rank by rank
                merged.setdefault(key, []).extend(value if isinstance(value, list) else [value])
    rank_keys = sorted({k for _, rank_values, _ in gathered for k in rank_values})
    rider_sums: dict[str, float] = {}
    for _, _, rank_riders in gathered:
        sum_logs(rider_sums, rank_riders)
    return SyncedStats(
        totals=merged,
        per_rank={key: [float(rank_values.get(key, 0.0)) for _, rank_values, _ in gathered] for key in rank_keys},
        riders=rider_sums,
    )

"""The rest of one epoch as this rank's updates, re-planned whenever the per-rank split changes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

from torch.utils.data import Dataset

from hetfair.data.batch_plan import BatchPlan, split_counts
from hetfair.data.rank_batches import Collater, RankBatches
from hetfair.data.update_shape import UpdateShape


@dataclass
class Update:
    """One update's micro-batches on this rank (``None``: no samples in that step) and its global size."""

    micro_batches: list[Optional[dict[str, Any]]]
    global_samples: int
    """Samples of this update over all ranks (how far it moves the epoch)."""
    steps: int
    """Steps of the plan it takes (each one micro-batch per rank, or one per inner step: see :class:`EpochUpdates`)."""


@dataclass(frozen=True)
class EpochSchedule:
    """How an epoch is cut: per-rank capacities, samples per update and per step, and order."""

    caps: Sequence[int]
    shape: UpdateShape
    seed: int


class EpochUpdates:
    """Yields the updates of ``epoch`` from ``start`` (samples already done).

    ``split()`` is read after every update: when it returns another per-rank split (the
    load balancer moved it), the rest of the epoch is planned anew from there. The
    sequence of global batches never changes, only how each is shared out.

    ``pieces`` cuts each rank's share of a step into that many micro-batches (a pipeline's).

    ``inner_steps()``, read likewise, gives each rank's optimizer steps per update
    (``--inner-steps-by time``; ``None``: one each). Rank ``r`` taking ``k_r`` steps takes
    ``k_r`` times its share of each step, cut into ``k_r`` micro-batches of its share:
    steps grow to ``sum_r k_r * share_r`` samples, and the rank's micro-batches of an update
    come in ``k_r`` groups of one per step.
    """

    def __init__(self, dataset: Dataset, collater: Collater, schedule: EpochSchedule, rank: int, epoch: int,
                 start: int, split: Callable[[], Optional[Sequence[int]]], num_workers: int = 0,
                 pin_memory: bool = False, inner_steps: Callable[[], Optional[Sequence[int]]] = lambda: None,
                 pieces: int = 1) -> None:
        self.dataset = dataset
        self.collater = collater
        self.schedule = schedule
        self.rank = rank
        self.epoch = epoch
        self.start = start
        self.split = split
        self.inner_steps = inner_steps
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.pieces = pieces

    def steps_left(self) -> int:
        """Global batches (steps) left in the epoch, at the current split and inner steps."""
        _, _, shape = self._layout(self.split(), self.inner_steps())
        return shape.steps_for(len(self.dataset) - self.start)

    def __iter__(self) -> Iterator[Update]:
        done = self.start
        while done < len(self.dataset):
            shares, counts = self.split(), _copy(self.inner_steps())
            for update in self._updates_with_split(done, shares, counts):
                done += update.global_samples
                yield update
                if self.split() != shares or _copy(self.inner_steps()) != counts:
                    break

    def _layout(self, shares: Optional[Sequence[int]], counts: Optional[Sequence[int]]
                ) -> tuple[Sequence[int], Optional[Sequence[int]], UpdateShape]:
        """The plan's capacities, shares and shape at ``shares`` and inner steps ``counts``."""
        caps, shape = self.schedule.caps, self.schedule.shape
        if counts is None:
            return caps, shares, shape
        own = split_counts(shape.step_size, shares if shares is not None else caps, caps)  # at one step each
        grown = [count * samples for count, samples in zip(counts, own)]
        step = sum(grown)
        return [count * cap for count, cap in zip(counts, caps)], grown, UpdateShape(shape.steps_per_update * step, step)

    def _updates_with_split(self, start: int, shares: Optional[Sequence[int]],
                            counts: Optional[Sequence[int]]) -> Iterator[Update]:
        caps, shares, shape = self._layout(shares, counts)
        plan = BatchPlan(len(self.dataset), caps, self.schedule.seed, self.epoch, shuffle=True, shares=shares,
                         start=start, global_batch_size=shape.step_size, update_size=shape.update_size,
                         sizes=getattr(self.dataset, "sizes", None))
        pieces = counts[self.rank] if counts is not None else self.pieces
        batches = RankBatches(self.dataset, self.collater, plan, self.rank, num_workers=self.num_workers,
                              pin_memory=self.pin_memory, pieces=pieces)
        group: list[Optional[dict[str, Any]]] = []
        group_samples = steps = 0
        for index, sample in enumerate(batches):
            group.append(sample)
            if (index + 1) % pieces:
                continue
            group_samples += len(plan.global_batch(steps))
            steps += 1
            if steps % shape.steps_per_update == 0 or steps == plan.num_steps:
                yield Update(_by_inner_step(group, pieces), group_samples, len(group) // pieces)
                group, group_samples = [], 0


def _by_inner_step(micro_batches: list[Optional[dict[str, Any]]], pieces: int) -> list[Optional[dict[str, Any]]]:
    """An update's micro-batches (``pieces`` per step, step by step) ordered inner step by inner step: piece 0
    of every step, then piece 1, ..."""
    return [micro_batches[index] for piece in range(pieces) for index in range(piece, len(micro_batches), pieces)]


def _copy(counts: Optional[Sequence[int]]) -> Optional[list[int]]:
    return None if counts is None else list(counts)

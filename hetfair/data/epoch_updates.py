"""The rest of one epoch as this rank's updates, re-planned whenever the per-rank split changes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

from torch.utils.data import Dataset

from hetfair.data.batch_plan import BatchPlan
from hetfair.data.rank_batches import Collater, RankBatches
from hetfair.data.update_shape import UpdateShape


@dataclass
class Update:
    """One update's micro-batches on this rank (``None``: no samples in that step) and its global size."""

    micro_batches: list[Optional[dict[str, Any]]]
    global_samples: int
    """Samples of this update over all ranks (how far it moves the epoch)."""


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
    """

    def __init__(self, dataset: Dataset, collater: Collater, schedule: EpochSchedule, rank: int, epoch: int,
                 start: int, split: Callable[[], Optional[Sequence[int]]], num_workers: int = 0,
                 pin_memory: bool = False) -> None:
        self.dataset = dataset
        self.collater = collater
        self.schedule = schedule
        self.rank = rank
        self.epoch = epoch
        self.start = start
        self.split = split
        self.num_workers = num_workers
        self.pin_memory = pin_memory

    def steps_left(self) -> int:
        """Global batches (micro-batch steps) left in the epoch."""
        return self.schedule.shape.steps_for(len(self.dataset) - self.start)

    def __iter__(self) -> Iterator[Update]:
        done = self.start
        while done < len(self.dataset):
            shares = self.split()
            for update in self._updates_with_split(done, shares):
                done += update.global_samples
                yield update
                if self.split() != shares:
                    break

    def _updates_with_split(self, start: int, shares: Optional[Sequence[int]]) -> Iterator[Update]:
        schedule = self.schedule
        plan = BatchPlan(len(self.dataset), schedule.caps, schedule.seed, self.epoch, shuffle=True, shares=shares,
                         start=start, global_batch_size=schedule.shape.step_size,
                         update_size=schedule.shape.update_size, sizes=getattr(self.dataset, "sizes", None))
        batches = RankBatches(self.dataset, self.collater, plan, self.rank, num_workers=self.num_workers,
                              pin_memory=self.pin_memory)
        group: list[Optional[dict[str, Any]]] = []
        group_samples = 0
        for step, sample in enumerate(batches):
            group.append(sample)
            group_samples += len(plan.global_batch(step))
            if len(group) == schedule.shape.steps_per_update or step + 1 == plan.num_steps:
                yield Update(group, group_samples)
                group, group_samples = [], 0

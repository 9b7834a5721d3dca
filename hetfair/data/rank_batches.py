"""One rank's micro-batches of one batch plan, loaded by a DataLoader."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

from torch.utils.data import DataLoader, Dataset

from hetfair.data.batch_plan import BatchPlan

Collater = Callable[[list[Any]], dict[str, Any]]


class RankBatches:
    """Yields, for each step of ``plan``, this rank's batch or ``None``.

    ``None`` means the rank has no samples in that step (a small share of a short
    last batch); it must still join the step's collectives with zero weight.
    """

    def __init__(
        self,
        dataset: Dataset,
        collater: Collater,
        plan: BatchPlan,
        rank: int,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        self.dataset = dataset
        self.collater = collater
        self.plan = plan
        self.rank = rank
        self.num_workers = num_workers
        self.pin_memory = pin_memory

    def __iter__(self) -> Iterator[Optional[dict[str, Any]]]:
        index_lists = [self.plan.rank_indices(step, self.rank).tolist() for step in range(self.plan.num_steps)]
        non_empty = [indices for indices in index_lists if indices]
        if not non_empty:
            yield from (None for _ in index_lists)
            return
        loader = DataLoader(
            self.dataset,
            batch_sampler=non_empty,
            collate_fn=self.collater,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
        )
        batches = iter(loader)
        for indices in index_lists:
            yield next(batches) if indices else None


def dummy_batch(dataset: Dataset, collater: Collater) -> dict[str, Any]:
    """A one-sample batch that a rank without data runs with zero weight (so DDP's hooks fire)."""
    return collater([dataset[0]])

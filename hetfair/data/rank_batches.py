"""One rank's micro-batches of one batch plan, loaded by a DataLoader."""

from __future__ import annotations

import multiprocessing
import sys
from typing import Any, Callable, Iterator, Optional

import numpy as np
from torch.utils.data import DataLoader, Dataset

from hetfair.data.batch_plan import BatchPlan
from hetfair.launch.supervisor import die_with_rank

Collater = Callable[[list[Any]], dict[str, Any]]


def worker_context() -> Optional[Any]:
    """How DataLoader workers start: forked on Linux, as torch does in a process torchrun started.

    A rank that hetfair's launcher spawned inherits the spawn method, and spawned DataLoader
    workers import torch again (seconds each under load), cannot import a ``--user-dir``
    plugin's dataset, and register their queues' semaphores with the launcher's resource
    tracker, which reports them as leaked when a rank is stopped ("leaked semaphore objects").
    Forked workers share the rank's modules, and their semaphores are unlinked at creation.
    """
    return multiprocessing.get_context("fork") if sys.platform.startswith("linux") else None


class RankBatches:
    """Yields, for each step of ``plan``, this rank's batch or ``None``; with ``pieces``, that many batches
    per step, the rank's samples of the step cut into near-equal consecutive parts.

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
        pieces: int = 1,
    ) -> None:
        self.dataset = dataset
        self.collater = collater
        self.plan = plan
        self.rank = rank
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.pieces = pieces

    def __iter__(self) -> Iterator[Optional[dict[str, Any]]]:
        index_lists = [piece.tolist() for step in range(self.plan.num_steps)
                       for piece in np.array_split(self.plan.rank_indices(step, self.rank), self.pieces)]
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
            multiprocessing_context=worker_context() if self.num_workers > 0 else None,
            worker_init_fn=die_with_rank if self.num_workers > 0 else None,
        )
        batches = iter(loader)
        for indices in index_lists:
            yield next(batches) if indices else None


def dummy_batch(dataset: Dataset, collater: Collater) -> dict[str, Any]:
    """A one-sample batch that a rank without data runs with zero weight (so DDP's hooks fire)."""
    return collater([dataset[0]])

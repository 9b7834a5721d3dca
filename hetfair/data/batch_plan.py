"""Per-rank batch plans: one global batch sequence, split among ranks by share.

The sequence of *global* batches depends only on the seed, the epoch and the
global batch size; how each global batch is split among ranks depends only on
the per-rank capacities and shares, which every rank knows. So all ranks agree
on the plan without communicating and run the same number of steps per epoch.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from hetfair.data.update_shape import UpdateShape


def split_counts(total: int, shares: Sequence[float], caps: Sequence[int]) -> list[int]:
    """Split ``total`` items among ranks in proportion to ``shares``, never above ``caps``.

    Water-filling: ranks whose proportional part would exceed their cap get the
    cap and the rest is re-split among the others; fractional parts are then
    rounded by largest remainder (ties to the lower rank), so the result is
    deterministic and sums to ``total``.
    """
    if total > sum(caps):
        raise ValueError(f"cannot split {total} items among ranks with capacities {list(caps)}")
    if any(s < 0 for s in shares) or len(shares) != len(caps):
        raise ValueError(f"invalid shares {list(shares)} for capacities {list(caps)}")
    capped: set[int] = set()
    ideal = [0.0] * len(caps)
    while True:
        free = [r for r in range(len(caps)) if r not in capped and caps[r] > 0]
        left = total - sum(caps[r] for r in capped)
        weight = sum(shares[r] for r in free)
        for r in free:
            ideal[r] = left * shares[r] / weight if weight > 0 else left * caps[r] / sum(caps[f] for f in free)
        over = [r for r in free if ideal[r] > caps[r]]
        if not over:
            break
        for r in over:
            capped.add(r)
            ideal[r] = float(caps[r])
    counts = [min(int(math.floor(x + 1e-9)), caps[r]) for r, x in enumerate(ideal)]
    order = sorted(range(len(caps)), key=lambda r: (-(ideal[r] - counts[r]), r))
    missing = total - sum(counts)
    while missing > 0:
        for r in order:
            if missing and counts[r] < caps[r]:
                counts[r] += 1
                missing -= 1
    return counts


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The order of sample indices in ``epoch``: a permutation drawn from (seed, epoch)."""
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(num_samples).astype(np.int64)


def by_length_within_updates(order: np.ndarray, sizes: np.ndarray, update_size: int) -> np.ndarray:
    """``order`` with each update's samples (consecutive runs of ``update_size``) sorted by ``sizes``.

    Length buckets for dynamic padding: each micro-batch then holds samples of similar length.
    Which samples an update takes is unchanged, so its (summed) gradient is the same whatever
    the ranks and steps it is split into; ties keep the shuffled order, so the plan stays a
    function of the seed and the epoch.
    """
    updates = np.arange(len(order)) // update_size
    return order[np.lexsort((np.asarray(sizes)[order], updates))]


class BatchPlan:
    """Which sample indices each rank processes at each step of one epoch.

    Args:
        num_samples: size of the dataset.
        caps: per-rank capacity (samples per micro-batch); their sum is the global batch.
        seed, epoch, shuffle: determine the order of samples.
        shares: relative share of each global batch per rank (default: ``caps``).
        start: samples of the epoch already done (resuming); steps count from there.
        global_batch_size: samples per step over all ranks (default: ``sum(caps)``); a
            smaller value leaves room to move the split without exceeding any cap.
        update_size: samples per update (default: one step's); each update's samples are cut
            into steps of ``global_batch_size``, its last step taking the rest (see
            :class:`~hetfair.data.update_shape.UpdateShape`). ``start`` is an update boundary.
        sizes: each sample's length (a dataset's ``sizes``, e.g. in tokens); given, each update's
            samples are ordered by length (see :func:`by_length_within_updates`).
    """

    def __init__(
        self,
        num_samples: int,
        caps: Sequence[int],
        seed: int,
        epoch: int,
        shuffle: bool = True,
        shares: Sequence[float] | None = None,
        start: int = 0,
        global_batch_size: int | None = None,
        update_size: int | None = None,
        sizes: Sequence[int] | np.ndarray | None = None,
    ) -> None:
        self.caps = [int(c) for c in caps]
        self.shares = [float(s) for s in (shares if shares is not None else caps)]
        self.global_batch_size = sum(self.caps) if global_batch_size is None else int(global_batch_size)
        if not 0 < self.global_batch_size <= sum(self.caps):
            raise ValueError(f"global batch {self.global_batch_size} does not fit capacities {self.caps}")
        self.shape = UpdateShape(update_size or self.global_batch_size, self.global_batch_size)
        self.order = epoch_order(num_samples, seed, epoch, shuffle)[start:]
        if sizes is not None:
            self.order = by_length_within_updates(self.order, np.asarray(sizes), self.shape.update_size)
        self.num_steps = self.shape.steps_for(len(self.order))

    def global_batch(self, step: int) -> np.ndarray:
        start, end = self.shape.step_bounds(step)
        return self.order[start:end]

    def rank_counts(self, step: int) -> list[int]:
        return split_counts(len(self.global_batch(step)), self.shares, self.caps)

    def rank_indices(self, step: int, rank: int) -> np.ndarray:
        """The contiguous slice of global batch ``step`` that ``rank`` processes."""
        counts = self.rank_counts(step)
        start = sum(counts[:rank])
        return self.global_batch(step)[start : start + counts[rank]]

"""Automatic load balancing: split each global batch so that all ranks finish together.

After every update each rank knows every rank's samples and compute seconds
(the trainer syncs them in its single stats all-reduce). The balancer smooths
them (an exponential moving average per rank) into a cost per sample at the
current split and, every ``interval`` updates, computes the split that equalises
the predicted step times, ``n_r`` proportional to ``1 / cost_r`` and water-filled
under each rank's cap. It adopts that split only when the predicted step time
(the slowest rank's) drops by more than ``threshold``: hysteresis against noise.

Costs are always measured at the split in use (measurements restart after each
re-split), so a fixed per-step overhead is folded into them. With
``time_r(n) = overhead_r + n * cost_r`` the rule ``n_r ∝ n_r / time_r`` has its
fixed point exactly where all step times are equal, and it converges to it over
successive re-splits. Everything is plain Python on numbers that are identical on
every rank, so every rank computes the same split without communicating.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from hetfair.data.batch_plan import split_counts


@dataclass(frozen=True)
class BalanceConfig:
    """Tuning of the load balancer (the ``--balance-*`` flags, where the defaults live)."""

    warmup_updates: int
    """Updates ignored after the process starts (start-up costs distort timings)."""
    interval: int
    """Measured updates between two re-split decisions."""
    smoothing: float
    """Weight of the newest update in the moving averages (1: no smoothing)."""
    threshold: float
    """Re-split only if the predicted step time drops by more than this fraction."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "BalanceConfig":
        return cls(args.balance_warmup_updates, args.balance_interval, args.balance_smoothing,
                   args.balance_threshold)


class LoadBalancer:
    """Chooses the per-rank split of each global batch from measured compute times.

    ``split[r]`` is the number of samples rank ``r`` takes from a full global batch;
    it never exceeds ``caps[r]`` and is at least 1, so every rank stays measured.
    """

    def __init__(self, caps: Sequence[int], global_batch_size: int, config: BalanceConfig) -> None:
        if not len(caps) <= global_batch_size <= sum(caps):
            raise ValueError(f"global batch {global_batch_size} must give each of {len(caps)} ranks a sample "
                             f"and fit their capacities {list(caps)}")
        self.caps = [int(c) for c in caps]
        self.global_batch_size = int(global_batch_size)
        self.config = config
        self.split = self._split_for(self.caps)
        self.resplits = 0
        self._updates_seen = 0
        self._restart_measurements()

    def observe(self, samples: Sequence[float], seconds: Sequence[float]) -> Optional[list[int]]:
        """Record one update's per-rank samples and compute seconds; return the new split if it changes."""
        self._updates_seen += 1
        if self._updates_seen <= self.config.warmup_updates:
            return None
        self._average(samples, seconds)
        self._measured += 1
        if self._measured % self.config.interval != 0:
            return None
        proposal = self._propose()
        if proposal is None:
            return None
        self.split = proposal
        self.resplits += 1
        self._restart_measurements()
        return list(proposal)

    def _propose(self) -> Optional[list[int]]:
        """The split balancing the measured costs, if it beats the current one by more than the threshold."""
        costs = self._costs()
        if costs is None:
            return None
        candidate = self._split_for([1.0 / cost for cost in costs])
        current_time = predicted_step_time(costs, self.split)
        if predicted_step_time(costs, candidate) >= (1.0 - self.config.threshold) * current_time:
            return None
        return candidate

    def _costs(self) -> Optional[list[float]]:
        """Smoothed seconds per sample of each rank at the current split (``None`` until measured)."""
        if self._measured == 0 or min(self._samples) <= 0 or min(self._seconds) <= 0:
            return None
        return [seconds / samples for seconds, samples in zip(self._seconds, self._samples)]

    def _average(self, samples: Sequence[float], seconds: Sequence[float]) -> None:
        # averages of samples and of seconds (not of their ratio): a short last batch or a
        # rank that ran only a zero-weight dummy batch counts with its real weight; the
        # first update at a split starts the averages
        weight = 1.0 if self._measured == 0 else self.config.smoothing
        self._samples = [(1 - weight) * old + weight * new for old, new in zip(self._samples, samples)]
        self._seconds = [(1 - weight) * old + weight * new for old, new in zip(self._seconds, seconds)]

    def _restart_measurements(self) -> None:
        self._measured = 0
        self._samples = [0.0] * len(self.caps)
        self._seconds = [0.0] * len(self.caps)

    def _split_for(self, weights: Sequence[float]) -> list[int]:
        counts = split_counts(self.global_batch_size, weights, self.caps)
        for rank, count in enumerate(counts):
            if count == 0:  # take one sample from the largest part (ties: lowest rank)
                donor = max(range(len(counts)), key=lambda r: (counts[r], -r))
                counts[donor] -= 1
                counts[rank] = 1
        return counts

    # -- checkpoint state ------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain data: the split and the measurements taken at it."""
        return {"split": list(self.split), "resplits": self.resplits, "measured": self._measured,
                "samples": list(self._samples), "seconds": list(self._seconds)}

    def load_state_dict(self, state: dict[str, Any]) -> bool:
        """Restore a saved state; ``False`` (and nothing restored) when its split does not fit this run."""
        split = [int(n) for n in state["split"]]
        fits = (len(split) == len(self.caps) and sum(split) == self.global_batch_size
                and all(1 <= n <= cap for n, cap in zip(split, self.caps)))
        if not fits:
            return False
        self.split = split
        self.resplits = int(state["resplits"])
        self._measured = int(state["measured"])
        self._samples = [float(x) for x in state["samples"]]
        self._seconds = [float(x) for x in state["seconds"]]
        return True


def predicted_step_time(costs: Sequence[float], split: Sequence[int]) -> float:
    """Compute time of one step: the slowest rank's, with costs linear in its samples."""
    return max(cost * count for cost, count in zip(costs, split))

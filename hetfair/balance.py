"""Automatic load balancing: split each global batch so that all ranks finish together.

The first split is in proportion to each rank's speed where a start-up probe measured them (``speeds``:
one short step per rank, see :func:`probe_samples`), else to the ranks' batch sizes. From a probed
start, which is near balance already, the first decision comes after one measured update.

After every update each rank knows every rank's samples and compute seconds
(the trainer syncs them in its single stats all-reduce). The balancer averages
them per rank (a running mean over the first updates at a split, then an
exponential moving average) and, after ``first_interval`` measured updates at
the start (and after a speed change), then every ``interval`` ones, computes
the split that equalises the predicted step times, water-filled under each
rank's cap. It adopts that split only when the predicted step time (the slowest
rank's) drops by more than ``threshold``: hysteresis against noise.

The model of a rank's step time is ``time_r(n) = overhead_r + n * cost_r``.
Measured at one split only, the overhead is unknown and taken as 0: the first
re-split is proportional to the measured speeds (``n_r ∝ n_r / time_r``, whose
fixed point is where all step times are equal). Once a rank has been measured at
two splits far enough apart, the line through both points gives its overhead and
cost, and the next split solves ``overhead_r + n_r * cost_r = T`` exactly, so a
linear cluster converges in two re-splits.

A rank whose step time departs from its average by more than ``change`` (same
direction, two updates in a row) has changed speed: the measurements restart
from those two updates and the old points are dropped, so the split follows
within a few updates; noise below ``change`` never triggers it. Everything is
plain Python on numbers that are identical on every rank, so every rank
computes the same split without communicating.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from hetfair.data.batch_plan import split_counts
from hetfair.errors import ConfigError

_MIN_SPREAD = 0.2
"""Two splits of a rank give its overhead only when they differ by this fraction of the larger."""
FIRST_INTERVAL = 2
"""Measured updates before the first decision with the command's flags (see :meth:`BalanceConfig.from_args`)."""
_MAX_OVERHEAD = 0.9
"""Fitted overheads are clamped to this fraction of the measured step time."""
STARTS = ("probe", "batch-sizes")
"""Where ``--balance-start`` starts the split: the probed speeds, or the batch sizes."""
PROBE_PART = 8
"""The start-up probe times a step of this part of a rank's starting share (at least one sample): with the
untimed step before it, a quarter of that rank's first step, cheaper than one update at an unbalanced split."""


def probe_samples(share: int) -> int:
    """Samples of the start-up probe's step on a rank whose share of a step at the batch sizes' split is ``share``."""
    return max(1, -(-share // PROBE_PART))


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
    change: float = 0.25
    """A rank's step time off its average by more than this fraction twice in a row: re-measure."""
    first_interval: int = 0
    """Measured updates before the first decision and the one after a speed change (0: ``interval``)."""
    lag: int = 0
    """Updates between an update and the arrival of its timings: after a re-split, the next ``lag``
    observations still measure the old split and are dropped."""
    start: str = "probe"
    """Where the split starts (one of :data:`STARTS`): the run probes speeds for ``probe``."""

    @classmethod
    def from_args(cls, args: argparse.Namespace, lag: int = 0) -> "BalanceConfig":
        """The flags' tuning; a ``--balance-start`` not in :data:`STARTS` is a :class:`ConfigError`."""
        if args.balance_start not in STARTS:
            raise ConfigError(f"--balance-start must be one of {', '.join(STARTS)}, got '{args.balance_start}'")
        # from the batch sizes the first decision (far from balance, where waiting costs most) comes after 2
        # measured updates
        return cls(args.balance_warmup_updates, args.balance_interval, args.balance_smoothing,
                   args.balance_threshold, first_interval=min(FIRST_INTERVAL, args.balance_interval), lag=lag,
                   start=args.balance_start)


class LoadBalancer:
    """Chooses the per-rank split of each global batch from measured compute times.

    ``split[r]`` is the number of samples rank ``r`` takes from a full global batch;
    it never exceeds ``caps[r]`` and is at least 1, so every rank stays measured. It starts
    in proportion to ``speeds`` (samples per second, e.g. probed) where given, else to ``caps``.
    """

    def __init__(self, caps: Sequence[int], global_batch_size: int, config: BalanceConfig,
                 speeds: Optional[Sequence[float]] = None) -> None:
        if not len(caps) <= global_batch_size <= sum(caps):
            raise ValueError(f"global batch {global_batch_size} must give each of {len(caps)} ranks a sample "
                             f"and fit their capacities {list(caps)}")
        self.caps = [int(c) for c in caps]
        self.global_batch_size = int(global_batch_size)
        self.config = config
        self.split = self._split_for(self.caps if speeds is None else speeds)
        # measured updates before the first decision: one from speeds (near balance already, and the threshold
        # keeps one update's noise from moving it), else the config's
        self._first_wait = config.first_interval if speeds is None else min(1, config.first_interval)
        self.resplits = 0
        self._updates_seen = 0
        self._stale = 0  # observations still to come that measure a superseded split
        # per rank (samples, seconds) averaged at the previous split, or None: the second point of the line
        self._previous: Optional[list[Optional[list[float]]]] = None
        # the last update's (samples, seconds) and the ranks, with the sign, that departed from the average
        self._last: Optional[list[list[float]]] = None
        self._departed: list[int] = []
        self._fresh = True  # no decision yet at these speeds: the next comes after first_interval updates
        self._restart_measurements()

    def observe(self, samples: Sequence[float], seconds: Sequence[float]) -> Optional[list[int]]:
        """Record one update's per-rank samples and compute seconds; return the new split if it changes.

        Empty lists (an update without timings) are ignored.
        """
        if not samples:
            return None
        if self._stale:
            self._stale -= 1
            return None
        self._updates_seen += 1
        if self._updates_seen <= self.config.warmup_updates:
            return None
        samples, seconds = [float(x) for x in samples], [float(x) for x in seconds]
        departed = self._departures(samples, seconds)
        if set(departed) & set(self._departed) and self._last is not None:
            # a rank changed speed: the averages restart from the two updates that showed it
            last_samples, last_seconds = self._last
            self._previous = None
            self._restart_measurements()
            self._fresh = True
            self._first_wait = self.config.first_interval
            self._average(last_samples, last_seconds)
            self._measured = 1
            departed = []
        self._departed = departed
        self._last = [samples, seconds]
        self._average(samples, self._clipped(samples, seconds))
        self._measured += 1
        if not self._deciding():
            return None
        proposal = self._propose()
        if proposal is None:
            return None
        self._previous = [[n, t] for n, t in zip(self._samples, self._seconds)]
        self.split = proposal
        self.resplits += 1
        self._stale = self.config.lag
        self._restart_measurements()
        return list(proposal)

    def _deciding(self) -> bool:
        """Whether this update ends a decision interval: ``first_interval`` (one from speeds) before the first
        decision, ``first_interval`` after a speed change (``_fresh``), then every ``interval`` measured updates."""
        if self._fresh and self._first_wait:
            if self._measured < self._first_wait:
                return False
            self._fresh = False
            self._measured_at_fresh = self._measured
            return True
        return (self._measured - self._measured_at_fresh) % self.config.interval == 0

    def _departures(self, samples: Sequence[float], seconds: Sequence[float]) -> list[int]:
        """Ranks (``+r + 1`` slower, ``-r - 1`` faster) whose time per sample is off the average by ``change``."""
        if self._measured == 0:
            return []
        departed = []
        for rank, (n, t, mean_n, mean_t) in enumerate(zip(samples, seconds, self._samples, self._seconds)):
            if n <= 0 or mean_n <= 0 or mean_t <= 0:
                continue
            ratio = (t / n) / (mean_t / mean_n)
            if ratio > 1 + self.config.change:
                departed.append(rank + 1)
            elif ratio < 1 - self.config.change:
                departed.append(-rank - 1)
        return departed

    def _clipped(self, samples: Sequence[float], seconds: Sequence[float]) -> list[float]:
        """Seconds held within ``change`` of the average's time per sample: one spike moves it little (a
        lasting change restarts the averages through :meth:`_departures` instead)."""
        if self._measured == 0:
            return list(seconds)
        clipped = []
        for n, t, mean_n, mean_t in zip(samples, seconds, self._samples, self._seconds):
            if n > 0 and mean_n > 0 and mean_t > 0:
                expected = n * mean_t / mean_n
                t = min(max(t, (1 - self.config.change) * expected), (1 + self.config.change) * expected)
            clipped.append(t)
        return clipped

    def _propose(self) -> Optional[list[int]]:
        """The split balancing the measured costs, if it beats the current one by more than the threshold."""
        model = self._model()
        if model is None:
            return None
        overheads, costs = model
        if any(overheads):
            candidate = self._split_for(self._equal_time_shares(overheads, costs))
        else:
            candidate = self._split_for([1.0 / cost for cost in costs])
        current_time = predicted_step_time(costs, self.split, overheads)
        if predicted_step_time(costs, candidate, overheads) >= (1.0 - self.config.threshold) * current_time:
            return None
        return candidate

    def _model(self) -> Optional[tuple[list[float], list[float]]]:
        """Per rank (overhead seconds, seconds per sample); overhead 0 where one split was measured."""
        costs = self._costs()
        if costs is None:
            return None
        overheads = [0.0] * len(costs)
        for rank, (n, t) in enumerate(zip(self._samples, self._seconds)):
            point = self._previous[rank] if self._previous is not None else None
            if point is None or abs(n - point[0]) < _MIN_SPREAD * max(n, point[0]):
                continue
            slope = (t - point[1]) / (n - point[0])
            if slope <= 0:
                continue
            overhead = min(max(t - slope * n, 0.0), _MAX_OVERHEAD * t)
            overheads[rank] = overhead
            costs[rank] = (t - overhead) / n
        return overheads, costs

    def _equal_time_shares(self, overheads: Sequence[float], costs: Sequence[float]) -> list[float]:
        """Real-valued samples per rank where ``overhead + n * cost`` is equal (within caps), summing to the batch."""
        def shares(time: float) -> list[float]:
            return [min(max((time - a) / b, 0.0), cap) for a, b, cap in zip(overheads, costs, self.caps)]

        low = min(overheads)
        high = max(a + b * cap for a, b, cap in zip(overheads, costs, self.caps))
        for _ in range(100):  # bisection on the common step time; deterministic plain floats
            middle = (low + high) / 2
            if sum(shares(middle)) < self.global_batch_size:
                low = middle
            else:
                high = middle
        return shares(high)

    def _costs(self) -> Optional[list[float]]:
        """Averaged seconds per sample of each rank at the current split (``None`` until measured)."""
        if self._measured == 0 or min(self._samples) <= 0 or min(self._seconds) <= 0:
            return None
        return [seconds / samples for seconds, samples in zip(self._seconds, self._samples)]

    def _average(self, samples: Sequence[float], seconds: Sequence[float]) -> None:
        # averages of samples and of seconds (not of their ratio): a short last batch or a
        # rank that ran only a zero-weight dummy batch counts with its real weight; a running
        # mean over the first updates at a split, then the moving average
        weight = max(self.config.smoothing, 1.0 / (self._measured + 1))
        self._samples = [(1 - weight) * old + weight * new for old, new in zip(self._samples, samples)]
        self._seconds = [(1 - weight) * old + weight * new for old, new in zip(self._seconds, seconds)]

    def _restart_measurements(self) -> None:
        self._measured = 0
        self._measured_at_fresh = 0
        self._samples = [0.0] * len(self.caps)
        self._seconds = [0.0] * len(self.caps)
        self._departed = []

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
        """Plain data: the ranks' batch sizes, the split and the measurements taken at it (and at the previous split)."""
        return {"caps": list(self.caps), "split": list(self.split), "resplits": self.resplits, "measured": self._measured,
                "samples": list(self._samples), "seconds": list(self._seconds),
                "previous": self._previous, "last": self._last, "departed": list(self._departed),
                "fresh": self._fresh, "measured_at_fresh": self._measured_at_fresh, "first_wait": self._first_wait}

    def load_state_dict(self, state: dict[str, Any]) -> bool:
        """Restore a saved state; ``False`` (and nothing restored) when it is another cluster's (other ranks
        or batch sizes: its measurements say nothing about this one) or its split does not fit this run."""
        split = [int(n) for n in state["split"]]
        saved_caps = state.get("caps")  # absent in checkpoints of older versions
        fits = ((saved_caps is None or [int(c) for c in saved_caps] == list(self.caps))
                and len(split) == len(self.caps) and sum(split) == self.global_batch_size
                and all(1 <= n <= cap for n, cap in zip(split, self.caps)))
        if not fits:
            return False
        self.split = split
        self.resplits = int(state["resplits"])
        self._measured = int(state["measured"])
        self._samples = [float(x) for x in state["samples"]]
        self._seconds = [float(x) for x in state["seconds"]]
        previous = state.get("previous")  # absent in checkpoints of older versions
        self._previous = None if previous is None else [
            None if point is None else [float(x) for x in point] for point in previous]
        last = state.get("last")
        self._last = None if last is None else [[float(x) for x in part] for part in last]
        self._departed = [int(r) for r in state.get("departed", [])]
        self._fresh = bool(state.get("fresh", False))
        self._measured_at_fresh = int(state.get("measured_at_fresh", 0))
        self._first_wait = int(state.get("first_wait", self.config.first_interval))
        return True


def predicted_step_time(costs: Sequence[float], split: Sequence[int],
                        overheads: Optional[Sequence[float]] = None) -> float:
    """Compute time of one step: the slowest rank's, with times ``overhead + count * cost``."""
    overheads = overheads if overheads is not None else [0.0] * len(costs)
    return max(a + cost * count for a, cost, count in zip(overheads, costs, split))

"""Statistics gathered between two log lines, turned into reported metrics."""

from __future__ import annotations

import time
from typing import Any, Callable

from hetfair.trainer import UpdateResult

ReduceMetrics = Callable[[dict[str, Any]], dict[str, float]]


class IntervalStats:
    """Sums update results between log lines and reports fairseq-style metrics.

    Metrics: the criterion's (loss, accuracy, ppl ...), ``lr``, ``gnorm`` (mean),
    ``clip`` (percent of updates clipped), ``ups`` (updates/s), ``wps``
    (tokens/s), ``bsz`` (samples per update), plus per rank ``share{r}`` (percent
    of the samples) and ``sps{r}`` (samples per second of its own compute), and
    ``balance_eff``: the compute time the interval's samples would have needed had
    every rank finished together at its measured speed, ``sum_r n_r / sum_r sps_r``,
    divided by the compute time it took, ``sum_u max_r t_{r,u}`` (each update waits
    for its slowest rank). 1 is perfect balance; an equal split on ranks of speeds
    1:1:2:4 gives 0.5.
    """

    def __init__(self, reduce_metrics: ReduceMetrics) -> None:
        self.reduce_metrics = reduce_metrics
        self.reset()

    def reset(self) -> None:
        self.totals: dict[str, float] = {}
        self.per_rank: dict[str, list[float]] = {}
        self.slowest_seconds = 0.0
        self.updates = 0
        self.gnorm_sum = 0.0
        self.clipped = 0
        self.lr = 0.0
        self.started = time.perf_counter()

    def add(self, result: UpdateResult) -> None:
        for key, value in result.totals.items():
            if isinstance(value, (int, float)):
                self.totals[key] = self.totals.get(key, 0.0) + float(value)
        for key, values in result.per_rank.items():
            previous = self.per_rank.get(key, [0.0] * len(values))
            self.per_rank[key] = [a + b for a, b in zip(previous, values)]
        self.slowest_seconds += max(result.per_rank.get("compute_seconds", [0.0]))
        self.updates += 1
        self.gnorm_sum += result.gnorm
        self.clipped += int(result.clipped)
        self.lr = result.lr

    def metrics(self) -> dict[str, float]:
        """The metrics of the interval so far (empty when no update happened)."""
        if self.updates == 0:
            return {}
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        metrics = dict(self.reduce_metrics(self.totals))
        metrics.update(
            lr=self.lr,
            gnorm=self.gnorm_sum / self.updates,
            clip=100.0 * self.clipped / self.updates,
            ups=self.updates / elapsed,
            wps=self.totals.get("ntokens", 0.0) / elapsed,
            bsz=self.totals.get("nsentences", 0.0) / self.updates,
        )
        samples = self.per_rank.get("samples", [])
        seconds = self.per_rank.get("compute_seconds", [])
        total_samples = sum(samples)
        for rank, (count, busy) in enumerate(zip(samples, seconds)):
            metrics[f"share{rank}"] = 100.0 * count / total_samples if total_samples else 0.0
            metrics[f"sps{rank}"] = count / busy if busy > 0 else 0.0
        total_speed = sum(count / busy for count, busy in zip(samples, seconds) if busy > 0)
        if total_speed > 0 and self.slowest_seconds > 0:
            metrics["balance_eff"] = total_samples / total_speed / self.slowest_seconds
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """Plain-data snapshot for checkpoints (timing restarts on load)."""
        return {"totals": dict(self.totals), "per_rank": {k: list(v) for k, v in self.per_rank.items()},
                "slowest_seconds": self.slowest_seconds, "updates": self.updates, "gnorm_sum": self.gnorm_sum,
                "clipped": self.clipped, "lr": self.lr}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reset()
        self.totals = dict(state["totals"])
        self.per_rank = {k: list(v) for k, v in state["per_rank"].items()}
        self.slowest_seconds = state["slowest_seconds"]
        self.updates = state["updates"]
        self.gnorm_sum = state["gnorm_sum"]
        self.clipped = state["clipped"]
        self.lr = state["lr"]

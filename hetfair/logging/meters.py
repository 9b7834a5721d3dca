"""Statistics gathered between two log lines, turned into reported metrics."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from hetfair.parallel.stats import UpdateResult, sum_logs

ReduceMetrics = Callable[[dict[str, Any]], dict[str, float]]


class IntervalStats:
    """Sums update results between log lines and reports fairseq-style metrics.

    Metrics: the criterion's (loss, accuracy, ppl ...), ``lr``, ``gnorm`` (mean),
    ``clip`` (percent of updates clipped), ``ups`` (updates/s), ``wps``
    (tokens/s, where the batches count tokens: ``ntokens``; else ``sps``, samples/s), ``bsz`` (samples per update), plus per rank ``share{r}`` (percent
    of the interval's samples) and ``sps{r}`` (samples per second of its own compute), and
    ``balance_eff``: the compute time the interval's samples would have needed had
    every rank finished together at its measured speed, ``sum_r n_r / sum_r sps_r``,
    divided by the compute time it took, ``sum_u max_r t_{r,u}`` (each update waits
    for its slowest rank). 1 is perfect balance; an equal split on ranks of speeds
    1:1:2:4 gives 0.5.

    Counts belong to the update that produced them; only the timings behind ``sps{r}`` and
    ``balance_eff`` are an update late (:attr:`UpdateResult.compute_seconds`), and are taken
    with the samples they measured.

    The seconds behind ``ups`` and ``wps`` / ``sps`` are the updates' own (data loading
    included), as the loop passes them to :meth:`add`: validation and checkpoint
    writing between updates do not count.

    With loss scaling (any rank in fp16) also ``loss_scale`` (the job's scale after
    the interval's last update) and ``skipped`` (updates dropped for an overflow).
    A skipped update counts only there: its loss, gradient norm and throughput
    belong to no applied update.
    """

    def __init__(self, reduce_metrics: ReduceMetrics) -> None:
        self.reduce_metrics = reduce_metrics
        self.reset()

    def reset(self) -> None:
        self.totals: dict[str, float] = {}
        self.samples: list[float] = []
        self.timed_samples: list[float] = []  # the samples that compute_seconds measured
        self.compute_seconds: list[float] = []
        self.slowest_seconds = 0.0
        self.updates = 0
        self.gnorm_sum = 0.0
        self.clipped = 0
        self.lr = 0.0
        self.seconds = 0.0
        self.skipped = 0
        self.loss_scale: Optional[float] = None

    def add(self, result: UpdateResult, seconds: float) -> None:
        """Count one update that took ``seconds`` of wall time (a skipped one only as skipped)."""
        self.seconds += seconds
        self.loss_scale = result.loss_scale
        if result.skipped:
            self.skipped += 1
            return
        sum_logs(self.totals, result.totals)
        self.samples = _add(self.samples, result.samples)
        self.timed_samples = _add(self.timed_samples, result.timed_samples)
        self.compute_seconds = _add(self.compute_seconds, result.compute_seconds)
        self.slowest_seconds += max(result.compute_seconds, default=0.0)
        self.updates += 1
        self.gnorm_sum += result.gnorm
        self.clipped += int(result.clipped)
        self.lr = result.lr

    def criterion_metrics(self) -> dict[str, float]:
        """Only the criterion's metrics (loss, accuracy ...) of the interval so far: cheap enough for every update."""
        return dict(self.reduce_metrics(self.totals)) if self.updates else {}

    def metrics(self) -> dict[str, float]:
        """The metrics of the interval so far (empty when no update happened)."""
        scaling = {} if self.loss_scale is None else {"loss_scale": self.loss_scale, "skipped": float(self.skipped)}
        if self.updates == 0:
            return scaling
        elapsed = max(self.seconds, 1e-9)
        metrics = dict(self.reduce_metrics(self.totals))
        metrics.update(
            lr=self.lr,
            gnorm=self.gnorm_sum / self.updates,
            clip=100.0 * self.clipped / self.updates,
            ups=self.updates / elapsed,
            **self._throughput(elapsed),
            bsz=self.totals.get("nsentences", 0.0) / self.updates,
        )
        total_samples = sum(self.samples)
        for rank, count in enumerate(self.samples):
            metrics[f"share{rank}"] = 100.0 * count / total_samples if total_samples else 0.0
        timed, seconds = self.timed_samples, self.compute_seconds
        for rank, (count, busy) in enumerate(zip(timed, seconds)):
            metrics[f"sps{rank}"] = count / busy if busy > 0 else 0.0
        total_speed = sum(count / busy for count, busy in zip(timed, seconds) if busy > 0)
        if total_speed > 0 and self.slowest_seconds > 0:
            metrics["balance_eff"] = sum(timed) / total_speed / self.slowest_seconds
        metrics.update(scaling)
        return metrics

    def _throughput(self, elapsed: float) -> dict[str, float]:
        """``wps`` (tokens per second) where the batches count tokens, else ``sps`` (samples per second)."""
        if "ntokens" in self.totals:
            return {"wps": self.totals["ntokens"] / elapsed}
        return {"sps": self.totals.get("nsentences", 0.0) / elapsed}

    def state_dict(self) -> dict[str, Any]:
        """Plain-data snapshot for checkpoints."""
        return {"totals": dict(self.totals), "samples": list(self.samples), "timed_samples": list(self.timed_samples),
                "compute_seconds": list(self.compute_seconds), "slowest_seconds": self.slowest_seconds,
                "updates": self.updates, "gnorm_sum": self.gnorm_sum, "clipped": self.clipped, "lr": self.lr,
                "seconds": self.seconds, "skipped": self.skipped, "loss_scale": self.loss_scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reset()
        self.totals = dict(state["totals"])
        self.samples = [float(x) for x in state["samples"]]
        # checkpoints written before counts travelled on time held the timed samples only
        self.timed_samples = [float(x) for x in state.get("timed_samples", state["samples"])]
        self.compute_seconds = [float(x) for x in state["compute_seconds"]]
        self.slowest_seconds = state["slowest_seconds"]
        self.updates = state["updates"]
        self.gnorm_sum = state["gnorm_sum"]
        self.clipped = state["clipped"]
        self.lr = state["lr"]
        self.seconds = float(state.get("seconds", 0.0))  # older checkpoints lack it
        self.skipped = int(state.get("skipped", 0))  # absent from checkpoints written before loss scaling
        self.loss_scale = state.get("loss_scale")


class Stopwatch:
    """Lap times: :meth:`lap` returns the seconds since the last lap or :meth:`restart`."""

    def __init__(self, clock: Optional[Callable[[], float]] = None) -> None:
        self._clock = clock or time.perf_counter
        self._last = self._clock()

    def restart(self) -> None:
        """Start the next lap now (time since the last lap is not counted)."""
        self._last = self._clock()

    def lap(self) -> float:
        now = self._clock()
        seconds, self._last = now - self._last, now
        return seconds


def _add(running: list[float], values: list[float]) -> list[float]:
    """Element-wise sum of per-rank lists. An update without timings (empty ``values``) adds nothing;
    the sums start anew when the ranks are others (empty ``running``, or a run resumed on another
    number of ranks)."""
    if not values:
        return running
    if len(running) != len(values):
        return list(values)
    return [a + b for a, b in zip(running, values)]

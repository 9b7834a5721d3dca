"""The stateful parts of a training run that are neither model nor optimizer: position, clock, batch, balancer."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from hetfair.balance import LoadBalancer
from hetfair.data.update_shape import UpdateShape


@dataclass
class Position:
    """Where training stands: the current epoch (1-based) and samples of it already done."""

    epoch: int = 1
    samples_done: int = 0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.samples_done = int(state["epoch"]), int(state["samples_done"])


class TrainingClock:
    """Wall-clock seconds spent training this job, carried across resumes."""

    def __init__(self) -> None:
        self._before = 0.0  # seconds of earlier runs of this job
        self._started = time.perf_counter()

    def seconds(self) -> float:
        return self._before + time.perf_counter() - self._started

    def state_dict(self) -> dict[str, Any]:
        return {"wall_seconds": self.seconds()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._before = float(state["wall_seconds"])
        self._started = time.perf_counter()


class BatchPart:
    """The job's global batch and ``--update-freq`` (which samples make an update), as a checkpoint part.

    They are what a resumed run must keep, whatever its ranks, to continue exactly; restoring
    hands the saved shape to ``on_restore``, which decides whether the command line overrides it.
    """

    def __init__(self, shape: Callable[[], UpdateShape], on_restore: Callable[[UpdateShape], None]) -> None:
        self.shape = shape
        self.on_restore = on_restore

    def state_dict(self) -> dict[str, Any]:
        shape = self.shape()
        return {"global_batch_size": shape.step_size, "update_freq": shape.steps_per_update}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.on_restore(UpdateShape.of(int(state["global_batch_size"]), int(state["update_freq"])))


class BalancerPart:
    """The load balancer as a checkpoint part: a saved split that no longer fits is dropped with a notice."""

    def __init__(self, balancer: Callable[[], LoadBalancer], notice: Callable[[str], None]) -> None:
        self.balancer = balancer  # the run's current one: a restored batch shape may replace it
        self.notice = notice

    def state_dict(self) -> dict[str, Any]:
        return self.balancer().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        balancer = self.balancer()
        if not balancer.load_state_dict(state):
            saved_caps = f" (batch sizes {list(state['caps'])})" if "caps" in state else ""
            self.notice(f"restore | saved split {state['split']}{saved_caps} does not fit this run's batch sizes "
                        f"{balancer.caps} and global batch {balancer.global_batch_size}: balancing starts afresh "
                        f"from {balancer.split}")

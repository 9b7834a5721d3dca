"""The stateful parts of a training run that are neither model nor optimizer: position, clock, balancer."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from hetfair.balance import LoadBalancer


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


class BalancerPart:
    """The load balancer as a checkpoint part: a saved split that no longer fits is dropped with a notice."""

    def __init__(self, balancer: LoadBalancer, notice: Callable[[str], None]) -> None:
        self.balancer = balancer
        self.notice = notice

    def state_dict(self) -> dict[str, Any]:
        return self.balancer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.balancer.load_state_dict(state):
            self.notice(f"restore | saved split {state['split']} does not fit this run's batch sizes "
                        f"{self.balancer.caps} and global batch {self.balancer.global_batch_size}: "
                        f"balancing starts afresh")

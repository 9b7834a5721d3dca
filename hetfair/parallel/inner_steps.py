"""``--inner-steps-by time``: how many inner steps each node of an outer loop takes per update, from its speed.

By count (the default) every node takes one inner optimizer step per update, so a round of
``--outer-interval H`` updates is H inner steps everywhere and a fast node waits for the slow one.
By time, node ``n`` takes ``k_n`` steps per update, each on a micro-batch of its own batch size:
``k_n = round(s_slowest / s_n)``, where ``s_n`` is the node's measured compute seconds per inner step
(its slowest rank's). The slowest node takes one; a node twice as fast takes two, so it trains twice the
samples in the same time and every node reaches the update's stats sync (and the round's outer sync)
together. The node's inner updates per round are ``k_n * H``.

The counts are decided at round boundaries only (a round's inner updates are fixed when it starts, so a
resume at a boundary is exact), from the mean of the round's measured updates: the first
:data:`WARMUP_UPDATES` are never measured (start-up, DDP's first bucket rebuild), nor is the update whose
timing arrives just after a change (it ran at the old counts). Later decisions keep the counts unless a
node's ideal ratio moved more than :data:`HYSTERESIS` past the rounding point, so noise near a half does not
flip them every round. Every rank sees the same timings (the trainer's stats all-reduce), so every rank
computes the same counts without communicating.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

INNER_STEPS_BY = ("count", "time")
"""``--inner-steps-by`` choices."""
WARMUP_UPDATES = 2
"""Updates whose timings are never measured."""
MIN_MEASURED = 2
"""Measured updates a decision needs (fewer: the round ends with the counts unchanged)."""
HYSTERESIS = 0.25
"""Once decided, a node's count changes only when its ideal ratio is more than ``0.5 + HYSTERESIS`` from it."""


class InnerStepCounts:
    """Every rank's inner steps per update (alike within a node), re-decided from measured compute times."""

    def __init__(self, nodes: Sequence[Sequence[int]]) -> None:
        self.nodes = [list(ranks) for ranks in nodes]
        self.counts = [1] * sum(len(ranks) for ranks in self.nodes)
        """Inner steps per update, by rank."""
        self.decided = False
        self._timed_updates = 0
        """Updates whose timings have arrived (the trainer's timings travel one update late)."""
        self._ignore_until = WARMUP_UPDATES
        self._sums = [0.0] * len(self.counts)
        self._measured = 0

    def observe(self, seconds: Sequence[float]) -> None:
        """Every rank's compute seconds of one update (ran at :attr:`counts`, unless just changed)."""
        self._timed_updates += 1
        if self._timed_updates <= self._ignore_until or len(seconds) != len(self.counts):
            return
        self._sums = [total + s / count for total, s, count in zip(self._sums, seconds, self.counts)]
        self._measured += 1

    def decide(self) -> Optional[list[int]]:
        """At a round boundary: the new counts by node when they change, else ``None``; measuring restarts."""
        if self._measured < MIN_MEASURED:
            return None
        per_step = [max(self._sums[rank] for rank in ranks) / self._measured for ranks in self.nodes]
        self._sums, self._measured = [0.0] * len(self.counts), 0
        slowest = max(per_step)
        wanted = [self._count(node, slowest / step if step > 0 else 1.0) for node, step in enumerate(per_step)]
        self.decided = True
        if wanted == self.node_counts():
            return None
        self.counts = list(self.counts)  # a new list: readers compare it with the one they planned with
        for node, ranks in enumerate(self.nodes):
            for rank in ranks:
                self.counts[rank] = wanted[node]
        self._ignore_until = self._timed_updates + 1  # the next timing to arrive is of an update at the old counts
        return wanted

    def _count(self, node: int, ratio: float) -> int:
        current = self.node_counts()[node]
        if self.decided and abs(ratio - current) <= 0.5 + HYSTERESIS:
            return current
        return max(1, round(ratio))

    def node_counts(self) -> list[int]:
        """Inner steps per update, by node."""
        return [self.counts[ranks[0]] for ranks in self.nodes]

    def state_dict(self) -> dict[str, Any]:
        return {"counts": list(self.counts), "decided": self.decided}

    def load_state_dict(self, state: dict[str, Any]) -> bool:
        """Take a checkpoint's counts; ``False`` (counts kept at one) where they are for another world."""
        counts = [int(count) for count in state.get("counts", [])]
        if len(counts) != len(self.counts) or any(len({counts[r] for r in ranks}) != 1 for ranks in self.nodes):
            return False
        self.counts, self.decided = counts, bool(state.get("decided", True))
        return True

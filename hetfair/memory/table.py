"""The ``memory |`` table after the first update: per rank what it holds, what it needed and what is left.

Each rank measures its first update (:class:`FirstUpdateMemory`): its peak memory (the
allocator's on CUDA, the resident set on CPU, :mod:`hetfair.memory.peak`) and, from the
peak of the forward and backward passes down to what is left of them when the optimizer
steps, the activations per sample. One gather brings every rank's numbers to the master,
which prints the table and, for a rank whose peak passed its budget, one warning naming
what would make it fit. (A warning, not an error: that update ran, so the budget is a plan
the real limit, the device or the kernel's, did not enforce; the next, larger batch may.)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch

from hetfair.memory.peak import current_bytes, peak_bytes, reset_peak
from hetfair.memory.sizes import format_size
from hetfair.parallel.collectives import all_gather_json
from hetfair.parallel.context import DistributedContext
from hetfair.parallel.strategy import Strategy


class FirstUpdateMemory:
    """Measures one update of this rank: built just before it, :meth:`finish` just after."""

    def __init__(self, device: torch.device, optimizer: torch.optim.Optimizer) -> None:
        self.device = device
        self.before = current_bytes(device)
        reset_peak(device)
        self.compute_peak: Optional[int] = None
        """The peak of the forward and backward passes (read when the optimizer steps)."""
        self.at_step: Optional[int] = None
        """The memory held when the optimizer steps: the gradients are there, the activations gone."""
        self._hook = optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, *_: object) -> None:
        self.compute_peak, self.at_step = peak_bytes(self.device), current_bytes(self.device)

    def finish(self, strategy: Strategy, optimizer: torch.optim.Optimizer, budget: Optional[int],
               samples: float, can_checkpoint: bool) -> "RankMemory":
        """This rank's row of the table, for an update over ``samples`` of its samples; ``can_checkpoint``: whether
        ``--activation-checkpointing 1`` would recompute anything here (its model has sharding units, not yet
        checkpointed)."""
        self._hook.remove()
        held = strategy.held_state_bytes(optimizer)
        activations = None
        if self.compute_peak is not None and self.at_step is not None and samples > 0:
            activations = max(0, self.compute_peak - self.at_step) / samples
        return RankMemory(budget, held["params"], held["grads"], held["optimizer"],
                          strategy.largest_gathered_unit_bytes(), activations, peak_bytes(self.device),
                          int(samples), self.before, can_checkpoint)


@dataclass(frozen=True)
class RankMemory:
    """One rank's row of the ``memory |`` table (JSON data: it travels to the master)."""

    budget: Optional[int]
    params: int
    grads: int
    optimizer: int
    largest_unit: int
    """Bytes of the largest unit gathered for compute (0: none)."""
    activations_per_sample: Optional[float]
    """Bytes of activations per sample of the first update (``None``: it had no samples or no step)."""
    peak: int
    """The peak memory of the first update: allocated on CUDA, resident on CPU (the interpreter included)."""
    samples: int
    before: int = 0
    """The memory held just before the first update (on CPU the resident set: the interpreter, torch, the
    model, the data), measured."""
    can_checkpoint: bool = False
    """Whether ``--activation-checkpointing 1`` would recompute anything on this rank."""

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def headroom(self) -> Optional[int]:
        return None if self.budget is None else self.budget - self.peak


def gather_rows(context: DistributedContext, own: RankMemory) -> list[RankMemory]:
    """Every rank's row, indexed by rank (one small gather)."""
    return [RankMemory(**row) for row in all_gather_json(context, asdict(own))]


HEADER = "memory | rank | budget | state: params + grads + optimizer | largest unit | activations/sample | peak | headroom"


def table_lines(rows: list[RankMemory]) -> list[str]:
    """The ``memory |`` table: a header, then one line per rank."""
    return [HEADER] + [f"memory | {rank} | {_size(row.budget)} | {format_size(row.state)}: "
                       f"{format_size(row.params)} + {format_size(row.grads)} + {format_size(row.optimizer)} | "
                       f"{format_size(row.largest_unit)} | {_size(row.activations_per_sample)} | "
                       f"{format_size(row.peak)} | {_size(row.headroom)}"
                       for rank, row in enumerate(rows)]


def over_budget_lines(rows: list[RankMemory], device_type: str, takes_fractions: bool) -> list[str]:
    """One warning per rank whose peak passed its budget, with what would make it fit (``takes_fractions``: the
    mode gives each rank the share of the state its fractions or budgets say)."""
    return [f"memory | warning: rank {rank}'s first update peaked at {format_size(row.peak)}, above its memory "
            f"budget {format_size(row.budget)}; {_remedy(rank, row, device_type, takes_fractions)}"
            for rank, row in enumerate(rows) if row.headroom is not None and row.headroom < 0]


BUDGET_MARGIN = 0.2
"""A budget suggested to a rank past it is this fraction above the peak it measured; a micro-batch suggested
to it keeps this fraction of its budget's room for activations free (the resident set varies from run to run)."""


def _remedy(rank: int, row: RankMemory, device_type: str, takes_fractions: bool) -> str:
    """What would bring ``row``'s rank under its budget: only remedies that can save what it went over by
    (the process's memory before the update is not theirs to save), and always a larger budget."""
    assert row.budget is not None
    larger = f"--memory-budget {format_size(row.peak * (1 + BUDGET_MARGIN))} for rank {rank}"
    if row.before >= row.budget:
        return (f"its process held {format_size(row.before)} before that update (measured: the interpreter, torch, "
                f"the model and the data), more than the budget, which no flag changes: try {larger}")
    over = row.peak - row.budget
    activations = (row.activations_per_sample or 0) * row.samples
    remedies = [f"--activation-checkpointing 1 on rank {rank}"] if row.can_checkpoint and activations > over else []
    if activations > over:
        room = (row.budget - (row.peak - activations)) * (1 - BUDGET_MARGIN)
        fitting = int(room // row.activations_per_sample)
        if 0 < fitting < row.samples:
            remedies.append(f"at most --max-sentences {fitting} on rank {rank} (it took {row.samples})")
    if row.state > over and takes_fractions:
        remedies.append("a larger share of the state for the other ranks (--shard-fractions or their "
                        "--memory-budget)")
        if device_type == "cuda":
            remedies.append(f"--offload 1 on rank {rank}")
    return "try " + ", or ".join([*remedies, larger])


def _size(value: Optional[float]) -> str:
    return "-" if value is None else format_size(value)

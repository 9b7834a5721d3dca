"""The memory plan of a job: each rank's share of the state from its budget, and whether that share fits.

A rank's share of the *batch* (``--max-sentences``, auto-balance) decides its speed; its
share of the *state* (parameters, gradients, optimizer state) decides its memory. Every
rank's budget is known from the start-up exchange (:mod:`hetfair.run.startup`), so every rank
completes the :class:`ParallelConfig` the same way and runs the same fit check, which
fails on every rank alike (no rank waits in a collective for one that gave up).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

from hetfair.errors import JobWideError
from hetfair.memory.budget import fractions_from_budgets
from hetfair.memory.sizes import format_size
from hetfair.parallel import STRATEGY_REGISTRY, ParallelConfig

MEASURED_SPREAD = 1.1
"""Budgets measured on the devices (free memory) move the shards only when the largest is this many times the
smallest: a few MiB of noise between alike devices keep their equal shards."""


def complete_parallel_config(config: ParallelConfig, budgets: Sequence[Optional[int]], measured: Sequence[bool],
                             notice: Callable[[str], None]) -> ParallelConfig:
    """``config`` with the shard sizes its budgets give, where the flags leave them open.

    A mode that splits its state by fractions gets ``shard_fractions`` in proportion to the
    budgets (unless ``--shard-fractions`` gave them); one that splits its optimizer state by weights
    (ZeRO-1) gets ``zero_shard_weights`` the same way (unless ``--zero-shard-weights`` gave them): what
    the strategy declares (:attr:`~hetfair.parallel.Strategy.takes_shard_fractions`,
    :meth:`~hetfair.parallel.Strategy.takes_shard_weights`). ``budgets`` and ``measured`` are by rank.
    """
    strategy = STRATEGY_REGISTRY.get(config.ddp_backend)
    open_fractions = strategy.takes_shard_fractions and config.shard_fractions is None
    open_weights = strategy.takes_shard_weights(config) and config.zero_shard_weights is None
    if len(budgets) < 2 or not (open_fractions or open_weights) or all(b is None for b in budgets):
        return config
    missing = [rank for rank, budget in enumerate(budgets) if budget is None]
    if missing:
        notice(f"memory | ranks {', '.join(map(str, missing))} have no --memory-budget (the others do): the state "
               f"is split evenly; give every rank a budget, or the shares themselves")
        return config
    known = [int(budget) for budget in budgets if budget is not None]
    if all(measured) and max(known) < MEASURED_SPREAD * min(known):
        return config
    if open_fractions:
        return replace(config, shard_fractions=fractions_from_budgets(known))
    return replace(config, zero_shard_weights=",".join(map(str, known)))


@dataclass(frozen=True)
class StateSize:
    """The whole model's training state, the sizes a rank's share is taken of."""

    param_bytes: int
    """Bytes of the trainable parameters (each gradient is as large)."""
    optimizer_ratio: float
    """Bytes of optimizer state per byte of parameter."""
    largest_unit_bytes: int
    """The largest unit gathered whole for compute (0: none)."""

    def of_rank(self, shares: tuple[float, float]) -> int:
        """Bytes a rank keeps with ``shares`` (of the parameters and gradients, of the optimizer state)."""
        return int(2 * self.param_bytes * shares[0] + self.optimizer_ratio * self.param_bytes * shares[1])


def check_fit(size: StateSize, shares: Sequence[tuple[float, float]], budgets: Sequence[Optional[int]],
              takes_fractions: bool, can_offload: bool = False) -> None:
    """Refuse, in one line naming the first rank and what would make it fit, a plan where a rank's state and its
    largest gathered unit exceed its budget (ranks without a budget are not checked); ``--offload`` is offered
    only where it ``can_offload`` (a GPU job: it moves state to host memory)."""
    for rank, (budget, share) in enumerate(zip(budgets, shares)):
        need = size.of_rank(share) + size.largest_unit_bytes
        if budget is None or need <= budget:
            continue
        raise JobWideError(f"rank {rank} would hold {format_size(size.of_rank(share))} of training state plus a "
                          f"gathered unit of {format_size(size.largest_unit_bytes)}, more than its memory budget "
                          f"{format_size(budget)}; "
                          f"{_remedy(size, rank, budget, len(budgets), takes_fractions, can_offload)}")


def _remedy(size: StateSize, rank: int, budget: int, world_size: int, takes_fractions: bool,
            can_offload: bool) -> str:
    offload = [f"--offload 1 on rank {rank} (a GPU rank: its shards and optimizer state in host memory)"] \
        if can_offload else []
    full = size.of_rank((1.0, 1.0))
    room = budget - size.largest_unit_bytes
    if not takes_fractions:
        return ", or ".join(["shard the state with --ddp-backend fully_sharded", *offload])
    share = math.floor(100 * room / full) / 100  # rounded down: the example must fit
    if room <= 0 or world_size < 2 or not 0 < share < 1:
        return ", or ".join([*offload, "smaller sharding units", f"a --memory-budget of at least "
                                                                 f"{format_size(full + size.largest_unit_bytes)}"])
    rest = (1.0 - share) / (world_size - 1)
    example = ",".join(f"{share if r == rank else rest:.2f}" for r in range(world_size))
    return ", or ".join([f"give it at most {share:.2f} of the state and the other ranks more (e.g. --shard-fractions "
                         f"{example}, or a larger --memory-budget elsewhere)", *offload])

"""The one start-up exchange: what each rank brings, and the settings every rank must be given alike.

Ranks may differ in precision, batch sizes and memory budgets (heterogeneous nodes), and every rank
must know every rank's; they must not differ where their collectives or their
shared loss scale would (``--ddp-backend``, ZeRO, the loss-scaling flags). One
all-gather carries both, and one error names every rank and setting that disagrees.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

from hetfair.parallel.collectives import all_gather_json
from hetfair.parallel.context import DistributedContext
from hetfair.errors import ConfigError

PARALLELISM = "parallelism"
LOSS_SCALE = "loss_scale"
_DISAGREEMENT = {
    PARALLELISM: "ranks {ranks} were given other --zero-sharding/--zero-shard-weights than rank 0 "
                 "(or another --ddp-backend)",
    LOSS_SCALE: "ranks {ranks} were given other --fp16-init-scale/--fp16-scale-window/--min-loss-scale/"
                "--threshold-loss-scale (or --update-freq) than rank 0, and the job shares one loss scale",
}
"""What a disagreement on each topic means, for the error."""


@dataclass(frozen=True)
class RankFacts:
    """What one rank tells the others (JSON data)."""

    precision: str
    train_capacity: int
    """Samples this rank takes per training micro-batch."""
    valid_capacity: int
    """Samples this rank takes per validation batch."""
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per topic (:data:`PARALLELISM`, :data:`LOSS_SCALE`), ``{flag: value}`` that must be the same everywhere."""
    memory_budget: Optional[int] = None
    """Bytes this rank may use (``--memory-budget``, else its device's free memory; ``None``: unknown)."""
    budget_measured: bool = False
    """The budget is the device's free memory at start-up, not a ``--memory-budget``."""


@dataclass(frozen=True)
class JobFacts:
    """What every rank knows after the exchange, indexed by rank."""

    precisions: list[str]
    train_caps: list[int]
    valid_caps: list[int]
    budgets: list[Optional[int]] = field(default_factory=list)
    budgets_measured: list[bool] = field(default_factory=list)


def agree_at_start_up(context: DistributedContext, own: RankFacts) -> JobFacts:
    """Exchange ``own`` with every rank (one collective) and :func:`check_agreement` on what came back:
    the same answer, or the same error, on every rank."""
    return check_agreement([RankFacts(**facts) for facts in all_gather_json(context, asdict(own))])


def check_agreement(ranks: list[RankFacts]) -> JobFacts:
    """What every rank knows, once the settings of ``ranks`` (indexed by rank) agree; else one
    :class:`ConfigError`. The loss-scaling flags must agree only when some rank runs fp16."""
    job = JobFacts([r.precision for r in ranks], [r.train_capacity for r in ranks], [r.valid_capacity for r in ranks],
                   [r.memory_budget for r in ranks], [r.budget_measured for r in ranks])
    topics = [PARALLELISM] + ([LOSS_SCALE] if "fp16" in job.precisions else [])
    problems = [problem for topic in topics if (problem := _disagreement(topic, ranks))]
    if problems:
        raise ConfigError("; ".join(problems) + "; give every node's command the same values")
    return job


def _disagreement(topic: str, ranks: list[RankFacts]) -> str | None:
    """What differs from rank 0 on ``topic``: the ranks, and each setting with every rank's value."""
    settings = [r.settings.get(topic, {}) for r in ranks]
    differing = [rank for rank, values in enumerate(settings) if values != settings[0]]
    if not differing:
        return None
    flags = sorted({flag for values in settings for flag in values})
    details = [_values_by_rank(flag, [values.get(flag) for values in settings]) for flag in flags]
    return _DISAGREEMENT[topic].format(ranks=differing) + ": " + ", ".join(d for d in details if d)


def _values_by_rank(flag: str, values: list[Any]) -> str | None:
    """``--flag a on rank 0, b on ranks 1, 2`` where the ranks' values differ, else ``None``."""
    by_value: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        by_value.setdefault(str(value), []).append(rank)
    if len(by_value) == 1:
        return None
    return flag + " " + ", ".join(f"{value} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
                                  for value, ranks in by_value.items())


def group_caps(caps: list[int], groups: list[list[int]], flag: str, probed: Sequence[bool] = ()) -> list[int]:
    """Batch sizes by data group (:meth:`Strategy.data_groups`: ranks that load the same samples) from ``caps`` by
    rank. A group's ranks must have been given the same ``flag``, else one :class:`ConfigError`; where the plan
    probed some of them (``probed``, by rank), the group takes the smallest."""
    chosen = []
    for group in groups:
        values = [caps[rank] for rank in group]
        if len(set(values)) > 1 and not any(probed[rank] for rank in group if rank < len(probed)):
            given = ", ".join(f"{value} on rank {rank}" for rank, value in zip(group, values))
            raise ConfigError(f"ranks {', '.join(map(str, group))} load the same samples (the stages of one "
                              f"pipeline) but were given different {flag} ({given}); give them the same {flag}")
        chosen.append(min(values))
    return chosen

"""Where a pipeline cuts the model and which ranks run which stage: pure functions of the flags and sizes.

A model's sharding units (its layers) are dealt out to the stages in order, each stage at
least one. ``--pipeline-split even`` gives near-equal counts (the first and last stages, which
also hold the embeddings and the head, get the smaller ones); ``auto`` minimises the slowest
stage's time given each stage's measured rate and the units each can hold
(:func:`balanced_split`); ``4,8`` is taken as given.
"""

from __future__ import annotations

from typing import Optional, Sequence

from hetfair.errors import ConfigError

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved")
"""``--pipeline-schedule``: torch's ``ScheduleGPipe``, ``Schedule1F1B`` or ``ScheduleInterleaved1F1B``."""
PIPELINE_LAYOUTS = ("across", "inside")
"""``--pipeline-layout``: stage s of every pipeline on consecutive ranks, or each pipeline on consecutive ranks."""
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved": 2}
"""Stages each rank runs under a schedule (interleaved 1F1B loops over two smaller stages per rank)."""


def stage_count(ranks_per_pipeline: int, schedule: str) -> int:
    """The stages the model is cut into: one per rank of a pipeline, two with ``interleaved``."""
    return ranks_per_pipeline * STAGES_PER_RANK[schedule]


def pipelines(world_size: int, ranks_per_pipeline: int, layout: str) -> list[list[int]]:
    """The ranks of each pipeline, by pipeline position: ``across`` puts position s of every pipeline on
    consecutive ranks (``rank = s * pipelines + p``), ``inside`` a pipeline on consecutive ranks."""
    count = world_size // ranks_per_pipeline
    if layout == "across":
        return [[position * count + pipe for position in range(ranks_per_pipeline)] for pipe in range(count)]
    return [[pipe * ranks_per_pipeline + position for position in range(ranks_per_pipeline)] for pipe in range(count)]


def check_split_text(text: str, stages: int) -> None:
    """``--pipeline-split`` at option parsing, before the model's units are known: one positive count per stage."""
    if text in ("even", "auto"):
        return
    counts = _counts(text)
    if len(counts) != stages or min(counts) < 1:
        raise ConfigError(f"--pipeline-split {text}: give one positive number of layers per stage ({stages} "
                          f"stages), like {','.join(['2'] * stages)}")


def _counts(text: str) -> list[int]:
    try:
        return [int(item) for item in text.split(",")]
    except ValueError:
        raise ConfigError(f"--pipeline-split {text}: give even, auto, or one whole number of layers per stage "
                          f"like 4,8") from None


def parse_split(text: str, units: int, stages: int) -> Optional[list[int]]:
    """``--pipeline-split``: the units of each stage given by hand, or ``None`` for ``even`` and ``auto``."""
    if text in ("even", "auto"):
        return None
    counts = _counts(text)
    if len(counts) != stages or min(counts) < 1 or sum(counts) != units:
        raise ConfigError(f"--pipeline-split {text}: give {stages} positive counts (one per stage) that add up to "
                          f"the model's {units} sharding units, like {','.join(map(str, even_split(units, stages)))}")
    return counts


def check_stages(units: int, stages: int, model: str, schedule: str = "1f1b") -> None:
    """Refuse a model without units, or more stages than units (``stages`` under ``schedule``)."""
    if units == 0:
        raise ConfigError(f"--ddp-backend pipeline: model {model} declares no sharding units (layers) to cut into "
                          f"stages; use another --ddp-backend")
    if stages > units:
        instead = " (or use --pipeline-schedule 1f1b: one stage per process)" if STAGES_PER_RANK[schedule] > 1 else ""
        raise ConfigError(f"--ddp-backend pipeline: {stages} stages need at least {stages} sharding units, but model "
                          f"{model} has {units}; lower --pipeline-stages{instead}")


def even_split(units: int, stages: int) -> list[int]:
    """Near-equal counts; where they cannot be equal, the middle stages take the extra units (the first and last
    also run the embeddings and the head)."""
    base, extra = divmod(units, stages)
    order = list(range(1, stages - 1)) + [stages - 1, 0] if stages > 2 else list(range(stages))[::-1]
    counts = [base] * stages
    for stage in order[:extra]:
        counts[stage] += 1
    return counts


def balanced_split(units: int, rates: Sequence[float], capacities: Sequence[int],
                   end_costs: tuple[float, float] = (0.0, 0.0)) -> list[int]:
    """The counts (each at least 1, at most its capacity) that minimise the slowest stage's time, where stage s
    takes ``count / rates[s]`` (plus ``end_costs`` in units of work on the first and the last stage).

    Exact, by dynamic programming over (stage, units so far): a pipeline has few stages and layers."""
    stages = len(rates)
    if sum(min(cap, units) for cap in capacities) < units or any(cap < 1 for cap in capacities):
        raise ConfigError(f"--pipeline-split auto: the {stages} stages hold at most {list(capacities)} layers, less "
                          f"than the model's {units}; add memory (--memory-budget) or stages")
    best: dict[tuple[int, int], tuple[float, list[int]]] = {(0, 0): (0.0, [])}
    for stage in range(stages):
        extra = (end_costs[0] if stage == 0 else 0.0) + (end_costs[1] if stage == stages - 1 else 0.0)
        following = stages - stage - 1
        for (done_stage, done), (worst, counts) in list(best.items()):
            if done_stage != stage:
                continue
            for count in range(1, min(capacities[stage], units - done - following) + 1):
                key = (stage + 1, done + count)
                time = max(worst, (count + extra) / rates[stage])
                if key not in best or time < best[key][0] - 1e-12:
                    best[key] = (time, counts + [count])
    if (stages, units) not in best:
        raise ConfigError(f"--pipeline-split auto: no split of {units} layers fits the stages' memory "
                          f"{list(capacities)}; add memory (--memory-budget) or stages")
    return best[(stages, units)][1]


def stage_rates(speeds: Sequence[float], pipes: Sequence[Sequence[int]], num_stages: int) -> list[float]:
    """Each stage's speed for :func:`balanced_split`: the slowest measured ``speeds`` (by rank) among the ranks at
    its position in the ``pipes`` (stage s runs at position ``s % len(pipe)``)."""
    width = len(pipes[0])
    at = [min(speeds[pipe[position]] for pipe in pipes) for position in range(width)]
    return [at[stage % width] for stage in range(num_stages)]


def stage_capacities(budgets: Sequence[Optional[int]], pipes: Sequence[Sequence[int]], num_stages: int,
                     unit_bytes: float, end_bytes: float, units: int) -> list[int]:
    """The units each stage's state fits: its position's smallest budget (by rank) less ``end_bytes`` (the
    embeddings and head, which the first and last stage hold), over ``unit_bytes`` (a unit's parameters, gradients
    and optimizer state), shared by the stages a rank runs; all ``units`` where a budget is unknown."""
    width = len(pipes[0])
    per_rank = num_stages // width
    capacities = []
    for stage in range(num_stages):
        known = [budgets[pipe[stage % width]] for pipe in pipes]
        if any(budget is None for budget in known):
            capacities.append(units)
        else:
            room = min(int(budget) for budget in known if budget is not None) - end_bytes
            capacities.append(max(0, int(room // (unit_bytes * per_rank))))
    return capacities


def unit_ranges(counts: Sequence[int]) -> list[range]:
    """Each stage's units as a range of unit indices."""
    starts = [sum(counts[:stage]) for stage in range(len(counts))]
    return [range(start, start + count) for start, count in zip(starts, counts)]


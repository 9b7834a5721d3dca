"""The job's plan: each rank's micro-batch, precision and the ``--ddp-backend``, agreed by every rank at start-up.

Two exchanges (:func:`~hetfair.parallel.collectives.all_gather_json`), always both, so that every rank
runs the same collectives whatever it was given: first each rank's device, budget and whether it holds
the replicated state with room for a micro-batch (for ``--ddp-backend auto``), then, after each
``auto`` rank probed its micro-batch (:mod:`hetfair.plan.probe`) for the chosen backend, each rank's
row of the plan. ``--ddp-backend auto`` replicates (``c10d``) when every rank holds the model's whole
state (parameters, gradients, optimizer state) and one micro-batch, else shards it
(``fully_sharded``) in proportion to the budgets (:func:`hetfair.memory.budget.fractions_from_budgets`):
the strategies whose :attr:`~hetfair.parallel.Strategy.plan_role` says so (:func:`hetfair.parallel.plan_candidate`).
What the plan does with a strategy it is given is what the strategy declares, never its name.
"""

from __future__ import annotations

import socket
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
from torch import nn

from hetfair.errors import ConfigError, JobWideError
from hetfair.memory.budget import device_budget, fractions_from_budgets
from hetfair.memory.peak import current_bytes
from hetfair.memory.sizes import format_size
from hetfair.parallel import PLAN_ROLES, STRATEGY_REGISTRY, plan_candidate
from hetfair.parallel.collectives import all_gather_json
from hetfair.parallel.context import DistributedContext
from hetfair.parallel.nodes import node_identity
from hetfair.plan import AUTO
from hetfair.plan.measure import device_memory, step_costs
from hetfair.plan.model_cost import state_cost
from hetfair.plan.predicted import Predicted, measured_cluster, predict_candidates, time_link
from hetfair.plan.probe import SAFETY_MARGIN, MicroBatchProbe, ProbeResult
from hetfair.plan.state import OptimizerFactory, StateSizes

if TYPE_CHECKING:  # the run's configuration is built above the plan; the plan only reads and replaces it
    from hetfair.run.config import RunConfig

SIZE_FLAGS = ("max_sentences", "max_tokens")


@dataclass(frozen=True)
class RankPlan:
    """One rank's row of the plan (JSON data: exchanged, shown, kept in the checkpoint)."""

    device: str
    memory: Optional[int]
    """The device's memory in bytes (a CPU's: the machine's)."""
    budget: Optional[int]
    """What the plan held this rank to (``--memory-budget``; on CUDA by default its free memory), ``None``: none."""
    precision: str
    probed: Optional[int]
    """The micro-batch the probe chose (``None``: given on the command line; 0: not even one sample fits)."""
    why: str
    probe_seconds: float = 0.0
    probe_steps: int = 0
    one_sample_bytes: int = 0
    held_before_probe: int = 0
    """The memory the process held before its first probe step (on CPU the resident set: the interpreter,
    torch, the model and the data), measured."""


@dataclass(frozen=True)
class JobPlan:
    """Every rank's row, the backend and the shard fractions (``None``: replicated or equal shards)."""

    ranks: list[RankPlan]
    backend: str
    backend_why: str
    fractions: Optional[tuple[float, ...]]
    automatic: bool
    """Whether any rank asked for something ``auto`` (then the plan is shown)."""
    predicted: tuple[Predicted, ...] = ()
    """``--ddp-backend auto``'s candidates with their predicted rates, fastest first (where it had a choice)."""

    def lines(self, caps: Sequence[int], shares: Sequence[float]) -> list[str]:
        """The ``plan |`` table: a header, a row per rank (its micro-batch ``caps[r]``, share of the global batch
        ``shares[r]``), the backend and the probing time."""
        rows = [("rank", "device", "memory", "budget", "precision", "micro-batch", "share", "shard", "why")]
        strategy = STRATEGY_REGISTRY.get(self.backend)
        for rank, row in enumerate(self.ranks):
            shard = "whole" if strategy.plan_role == "replicated" else "-" if not strategy.takes_shard_fractions \
                else f"{self.fractions[rank] if self.fractions else 1 / len(self.ranks):.2f}"
            rows.append((str(rank), row.device, _size(row.memory), _size(row.budget), row.precision, str(caps[rank]),
                         f"{shares[rank]:.2f}", shard, row.why))
        widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
        table = ["plan | " + " | ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
                 for row in rows]
        table.append(f"plan | --ddp-backend {self.backend}: {self.backend_why}")
        if self.predicted:
            chosen, *others = sorted(self.predicted, key=lambda p: p.backend != self.backend)
            per_rank = f"{chosen.batches} sample{'' if chosen.batches == '1' else 's'} a rank per update"
            table.append(f"plan | predicted ({per_rank}, on the measured devices and link): {chosen.words()}"
                         + "".join(f"; runner-up {other.words()}" for other in others[:1]))
        probed = [row for row in self.ranks if row.probed is not None]
        if probed:
            slowest = max(probed, key=lambda row: row.probe_seconds)
            table.append(f"plan | probing took {slowest.probe_seconds:.1f} s on the slowest rank "
                         f"({slowest.probe_steps} forward/backward steps, no optimizer step)")
        return table

    def summary(self, caps: Sequence[int]) -> dict[str, Any]:
        """What the checkpoint keeps, and compares on resume (plain data)."""
        return {"world_size": len(self.ranks), "backend": self.backend,
                "fractions": list(self.fractions) if self.fractions else None, "micro_batches": list(caps),
                "ranks": [asdict(row) for row in self.ranks]}


class PlanPart:
    """The plan as a checkpoint part: a resumed run makes its own plan and says how it differs from the saved one."""

    def __init__(self, summary: Callable[[], dict[str, Any]], notice: Callable[[str], None]) -> None:
        self.summary = summary
        self.notice = notice

    def state_dict(self) -> dict[str, Any]:
        return self.summary()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        now = self.summary()
        changes = [f"{name.replace('_', ' ')} {state.get(key)} -> {now[key]}"
                   for key, name in (("world_size", "world_size"), ("backend", "--ddp-backend"),
                                     ("micro_batches", "micro-batches"), ("fractions", "shard fractions"))
                   if state.get(key) != now[key]]
        if changes:
            self.notice("plan | the plan changed since the checkpoint: " + "; ".join(changes))


class Planner:
    """Makes one process's part of the :class:`JobPlan` (collectives: every rank must call :meth:`plan`)."""

    def __init__(self, config: "RunConfig", context: DistributedContext, model: nn.Module,
                 criterion: nn.Module, batch_of: Callable[[int], dict[str, Any]], samples: int,
                 positions: Optional[int], units: Sequence[nn.Module], build_optimizer: OptimizerFactory) -> None:
        self.config = config
        self.context = context
        self.model = model
        self.samples = samples
        self.positions = positions
        self.auto_sizes = [dest for dest in SIZE_FLAGS if getattr(config.data, dest) == AUTO]
        self.auto_backend = config.parallel.ddp_backend == AUTO
        self.budget = config.memory.budget or _device_budget(context.device)
        self.criterion = criterion
        self.batch_of = batch_of
        self.units = units
        self.build_optimizer = build_optimizer
        self._check_auto_sizes()
        self.probing = plan_probes(config, context.world_size)
        self.probe = MicroBatchProbe(model, criterion, batch_of, context.device, config.precision.precision,
                                     self.budget)
        self.sizes = StateSizes.of(model, units, build_optimizer) if self.probing else None

    def plan(self) -> tuple[JobPlan, "RunConfig"]:
        """The job's plan, and this process's configuration with every ``auto`` replaced by the plan's choice."""
        home = next(self.model.parameters()).device
        if self.probing:
            self.model.to(self.context.device)
        try:
            facts = all_gather_json(self.context, {"budget": self.budget, "fits": self._fits_replicated(),
                                                   "auto": bool(self.auto_sizes) or self.auto_backend})
            predicted = self._predicted([f["budget"] for f in facts], [f["fits"] for f in facts])
            backend, why, fractions = self._backend([f["budget"] for f in facts], [f["fits"] for f in facts],
                                                    predicted)
            rows = [RankPlan(**row) for row in all_gather_json(self.context, asdict(self._own_row(backend, fractions)))]
        finally:
            self.model.to(home)  # a sharded strategy shards it before it moves to the device
            if self.context.device.type == "cuda":
                torch.cuda.empty_cache()
        shards = STRATEGY_REGISTRY.get(backend).plan_role == "sharded"
        _refuse_too_small(rows, can_shard=self.context.world_size > 1 and not shards)
        plan = JobPlan(rows, backend, why, fractions, any(f["auto"] for f in facts), tuple(predicted))
        return plan, self._resolved(plan)

    # -- the backend -------------------------------------------------------------------
    def _fits_replicated(self) -> bool:
        """Whether this rank holds the replicated state and one micro-batch (its given one, else one sample)."""
        if not (self.auto_backend and self.context.world_size > 1):
            return True
        assert self.sizes is not None
        return self.probe.fits(self._given_capacity() or 1, self.sizes.reserve(None))[0]

    def _predicted(self, budgets: list[Optional[int]], fits: list[bool]) -> list[Predicted]:
        """Where ``--ddp-backend auto`` has a choice (several ranks, each holding the replicated state and a
        micro-batch), every candidate's predicted rate on the measured devices and link, fastest first
        (:mod:`hetfair.plan.predicted`; collectives); else none."""
        if not (self.auto_backend and self.context.world_size > 1 and all(fits)):
            return []
        batch = self._given_capacity() or 1
        device, precision = self.context.device, self.config.precision.precision
        cost = state_cost(self.model, self.units, self.build_optimizer)  # rates in samples/s: no FLOPs needed
        per_sample, overhead = step_costs(self.model, self.criterion, self.batch_of, device, precision,
                                          few=max(1, batch // 2), more=batch)  # each fits: ``batch`` did
        own = {"node": node_identity(), "host": socket.gethostname(), "device": device.type,
               "memory": self.budget or device_memory(device),
               "precision": precision, "seconds_per_sample": per_sample, "step_overhead": overhead,
               "flops_per_sample": cost.flops_per_sample, "batch": batch}
        facts = all_gather_json(self.context, own)
        cluster = measured_cluster(facts, time_link(self.context, cost.parameter_bytes))
        candidates = [plan_candidate(role) for role in PLAN_ROLES]
        return predict_candidates(cluster, cost, [fact["batch"] for fact in facts], candidates,
                                  _fractions_by_budget(budgets))

    def _backend(self, budgets: list[Optional[int]], fits: list[bool], predicted: Sequence[Predicted]
                 ) -> tuple[str, str, Optional[tuple[float, ...]]]:
        """The backend, why, and the shard fractions (by budget when every rank has one): the fastest ``predicted``
        where there are predictions, else by memory."""
        if not self.auto_backend:
            backend, given = self.config.parallel.ddp_backend, self.config.parallel.shard_fractions
            if STRATEGY_REGISTRY.get(backend).takes_shard_fractions and given is None:
                return backend, "as given", _fractions_by_budget(budgets)
            return backend, "as given", given
        if self.context.world_size == 1:
            return plan_candidate("replicated"), "one process, nothing to shard over", None
        assert self.sizes is not None
        state = format_size(self.sizes.replicated())
        holds = (f"every rank holds the model's state ({state}: parameters, gradients, optimizer state) and a "
                 f"micro-batch")
        if predicted and predicted[0].backend != plan_candidate("replicated"):
            fractions = _fractions_by_budget(budgets)
            return predicted[0].backend, f"{holds}, but sharding is predicted faster", fractions
        if all(fits):
            return plan_candidate("replicated"), f"{holds}: replicated", None
        short = ", ".join(str(rank) for rank, fit in enumerate(fits) if not fit)
        fractions = _fractions_by_budget(budgets)
        split = "by memory budget" if fractions else "equally (not every rank has a budget)"
        return plan_candidate("sharded"), (f"rank(s) {short} cannot hold the model's state ({state}: parameters, "
                                           f"gradients, optimizer state) and a micro-batch: sharded {split}"), fractions

    # -- this rank's micro-batch ---------------------------------------------------------
    def _own_row(self, backend: str, fractions: Optional[tuple[float, ...]]) -> RankPlan:
        device = self.context.device
        common = {"device": _device_name(device), "memory": device_memory(device), "budget": self.budget,
                  "precision": self.config.precision.precision}
        if not self.auto_sizes:
            given = ", ".join(f"--{dest.replace('_', '-')} {getattr(self.config.data, dest)}" for dest in SIZE_FLAGS
                              if getattr(self.config.data, dest) is not None)
            return RankPlan(**common, probed=None, why=f"given ({given})")
        assert self.sizes is not None
        share = None
        if STRATEGY_REGISTRY.get(backend).takes_shard_fractions:
            share = fractions[self.context.rank] if fractions else 1 / self.context.world_size
        upper = min(self.samples, self._given_capacity() or self.samples)
        held_before = current_bytes(device)
        result = self.probe.largest(upper, self.sizes.reserve(share))
        return RankPlan(**common, probed=result.micro_batch, why=_probe_why(result), probe_seconds=result.seconds,
                        probe_steps=result.steps, one_sample_bytes=result.one_sample_bytes,
                        held_before_probe=held_before)

    def _given_capacity(self) -> Optional[int]:
        """Samples per micro-batch the numeric one of ``--max-sentences`` / ``--max-tokens`` allows, if any."""
        sentences, tokens = self.config.data.max_sentences, self.config.data.max_tokens
        bounds = [sentences] if isinstance(sentences, int) else []
        if isinstance(tokens, int) and self.positions:
            bounds.append(max(1, tokens // self.positions))
        return min(bounds) if bounds else None

    def _check_auto_sizes(self) -> None:
        if "max_tokens" in self.auto_sizes and self.positions is None:
            raise ConfigError(f"task '{self.config.data.task}' has no fixed sample length; use --max-sentences auto "
                              f"instead of --max-tokens auto")
        if self.auto_sizes and self.budget is None:
            flag = "--" + self.auto_sizes[0].replace("_", "-")
            raise ConfigError(f"{flag} auto on CPU needs --memory-budget SIZE (this process's memory, e.g. 8G): "
                              f"a CPU has no device limit to probe against")

    def _resolved(self, plan: JobPlan) -> "RunConfig":
        sizes: dict[str, Any] = {}
        probed = plan.ranks[self.context.rank].probed
        if "max_sentences" in self.auto_sizes:
            sizes["max_sentences"] = probed
        if "max_tokens" in self.auto_sizes:
            sizes["max_tokens"] = int(probed or 0) * int(self.positions or 0)
        parallel = self.config.parallel
        if self.auto_backend:
            parallel = replace(parallel, ddp_backend=plan.backend)
        takes_fractions = STRATEGY_REGISTRY.get(plan.backend).takes_shard_fractions
        if self.auto_backend and takes_fractions and parallel.shard_fractions is None and plan.fractions:
            parallel = replace(parallel, shard_fractions=plan.fractions)
        return replace(self.config, data=replace(self.config.data, **sizes), parallel=parallel)


def plan_probes(config: "RunConfig", world_size: int) -> bool:
    """Whether the plan runs the whole model (``auto`` micro-batches, or ``--ddp-backend auto`` on several
    ranks): the model must then be built whole, not deferred."""
    return any(getattr(config.data, dest) == AUTO for dest in SIZE_FLAGS) or (
        config.parallel.ddp_backend == AUTO and world_size > 1)


def _probe_why(result: ProbeResult) -> str:
    if result.failed is None:
        return f"probed: all {result.upper} samples fit ({result.steps} steps, {result.seconds:.1f} s)"
    margin = f", {SAFETY_MARGIN:.0%} margin" if result.micro_batch < result.largest else ""
    return f"probed: {result.largest} fit, {result.failed} did not ({result.steps} steps, {result.seconds:.1f} s" \
           f"{margin})"


def _fractions_by_budget(budgets: Sequence[Optional[int]]) -> Optional[tuple[float, ...]]:
    """Shard fractions in proportion to the budgets when every rank has one, else ``None`` (equal shares)."""
    if any(budget is None for budget in budgets):
        return None
    return fractions_from_budgets([float(budget) for budget in budgets])  # type: ignore[arg-type]


def _refuse_too_small(rows: list[RankPlan], can_shard: bool) -> None:
    """One error, on every rank, naming the first rank where not even one sample fits its budget, and the
    remedies that can help: a budget for every such rank; sharding where the job has ranks to shard over, does
    not shard yet and each such budget was above what its process held before any step (sharding cannot
    shrink the interpreter); leaving them out where other ranks remain."""
    short = [rank for rank, row in enumerate(rows) if row.probed == 0]
    if not short:
        return
    row = rows[short[0]]
    raise JobWideError(f"rank {short[0]} ({row.device}) cannot train even one sample within its memory budget "
                      f"{_size(row.budget)} ({_what_one_sample_needs(row)}); "
                      f"{_remedies_for_one_sample(rows, short, can_shard)}")


TOO_SMALL_MARGIN = 0.2
"""The budget suggested to a rank too small for one sample is this fraction above what one sample needed
(the resident set varies from run to run, and the probe keeps a safety margin below what fitted)."""


def _what_one_sample_needs(row: RankPlan) -> str:
    needed = f"one sample and the training state need {format_size(row.one_sample_bytes)}"
    if _held_more_than_budget(row):
        return (f"{needed}; the process held {format_size(row.held_before_probe)} before any step, measured: "
                f"the interpreter, torch, the model and the data, more than the budget")
    return needed


def _held_more_than_budget(row: RankPlan) -> bool:
    return row.budget is not None and row.held_before_probe >= row.budget


def _remedies_for_one_sample(rows: list[RankPlan], short: list[int], can_shard: bool) -> str:
    suggested = format_size(max(rows[rank].one_sample_bytes for rank in short) * (1 + TOO_SMALL_MARGIN))
    names = ", ".join(map(str, short))
    whom = "it" if len(rows) == 1 else f"rank(s) {names}"
    remedies = [f"give {whom} a --memory-budget of at least {suggested}"]
    if can_shard and not any(_held_more_than_budget(rows[rank]) for rank in short):
        remedies.append("shard the state (--ddp-backend auto)")
    if len(short) < len(rows):
        remedies.append(f"leave rank(s) {names} out of the job")
    return ", ".join(remedies[:-1]) + (" or " if len(remedies) > 1 else "") + remedies[-1]


def _device_budget(device: torch.device) -> Optional[int]:
    """On CUDA, what this process may allocate: the device's free memory and what it holds already."""
    free = device_budget(device)
    return None if free is None else free + current_bytes(device)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _size(size: Optional[int]) -> str:
    return "-" if size is None else format_size(size)


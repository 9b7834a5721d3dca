"""Pick by measurement: is a replicated run bandwidth-bound, and which ``--ddp-comm-hook`` would help?

At start-up one all-reduce of the gradients' size is timed (the slowest rank's time,
shared); the trainer measures each rank's compute seconds per update anyway. With
those, :func:`advise` applies the rule below, the same on every rank (every number
it reads is the same on every rank), and the run logs it in one ``comm |`` line.

The rule: the exact fp32 all-reduce of ``B`` bytes takes ``t`` (measured); a hook
that sends ``b`` bytes (its declared cost ``b / B``, :meth:`CommHook.sent_fraction`)
is predicted to take ``t * b / B``: the cost model's ring all-reduce
(:mod:`hetfair.parallel.cost_model`) over the link the measurement gives, latency ignored
(bandwidth-bound links). The run is
*bandwidth-bound* when its ranks sit on more than one node (:mod:`hetfair.parallel.nodes`: their
traffic crosses a network link) and ``t`` is at least :data:`BOUND_RATIO` of the compute time of an update (the slowest rank's):
DDP overlaps the all-reduce with the backward pass, about that share of the compute,
so a longer one shows in the update time. Ranks of one node exchange gradients by
memory copies, which no hook shortens (each costs its own compute on the same
processors): measured on 3 loopback processes, PowerSGD was no faster at an
all-reduce of 0.8-1.3x the compute (docs/comm-hooks.md). Not bandwidth-bound: ``none``. Bound:
the advised hook predicted fastest (built-in: bf16, fp16 and powersgd; bf16 before fp16 at
equal bytes: it keeps fp32's range; each hook declares its place, :attr:`CommHook.tie_order`).
``auto`` switches that hook on and says so in the line; otherwise the line only suggests it.
A lossy hook is always named lossy.

Before the rule, a hook with a setting of ``auto`` fits it to the link (:meth:`CommHook.fit_link`:
``--powersgd-rank auto`` takes the largest rank whose all-reduce fits :data:`BOUND_RATIO` of the
compute), and its costs are read again. Where even the fastest advised hook's all-reduce is
:data:`OUTER_RATIO` times the compute, no hook will do: a second line names the outer loop's
settings that fit the link (:func:`fit_outer_loop`). No run switches strategy by itself, ``auto``
included: the line is a suggestion to run as typed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Protocol

from hetfair.cluster.description import Link
from hetfair.parallel.cost_model import all_reduce, send_to_all
from hetfair.parallel.outer_exchange import payload_bytes

BOUND_RATIO = 0.5
"""Bandwidth-bound: the exact all-reduce takes at least this share of an update's compute time."""

ADVISE_AFTER = 3
"""The compute time is that of the update attempt with this number: the first one's holds warm-up work, the
second's DDP's bucket rebuild, a sync between the ranks at its forward (over a 256 kbit/s link, 25 ms against the
1-3 ms of the updates around it)."""

EXACT = "none"
"""The exact all-reduce: the mode when not bandwidth-bound."""

OUTER_RATIO = 3.0
"""No hook will do: even the fastest advised hook's all-reduce takes this many times an update's compute."""

OUTER_INTERVALS = (4, 8, 16, 32, 64)
"""``--outer-interval`` values the outer-loop advice weighs, the smallest (the closest to DDP's loss) first."""

OUTER_DTYPES = ("fp32", "bf16", "int8", "int4")
"""``--outer-reduce-dtype`` values it weighs at each interval, the least lossy first."""

OUTER_FRAGMENTS = 4
"""``--outer-fragments`` it suggests: each fragment's exchange runs behind a quarter of the round's inner steps."""


@dataclass(frozen=True)
class HookCost:
    """What the advice knows of one comm hook (:class:`hetfair.parallel.comm_hook.CommHook`)."""

    name: str
    sent: float
    """Bytes it sends per update, relative to the exact all-reduce's."""
    lossy: bool
    advised: bool
    """The advice may suggest it (and ``auto`` switch it on)."""


@dataclass(frozen=True)
class LinkMeasurement:
    """What one start-up all-reduce told about the link, and what each hook would send over it."""

    gradient_bytes: int
    """Bytes the exact all-reduce sends per update (all gradients, fp32)."""
    all_reduce_seconds: float
    """Seconds of one all-reduce of ``gradient_bytes``: the slowest rank's."""
    nodes: int
    """The nodes the job's ranks sit on (1: no network link between them)."""
    hooks: tuple[HookCost, ...]
    """This run's hooks, in order of preference at equal predicted time."""
    parameters: int
    """Values of the trainable parameters: what an outer-loop round exchanges."""
    world_size: int
    """The job's ranks: each sends its share of every all-reduce and its whole payload to every all-gather."""
    boundary_bytes: float = 0.0
    """Bytes a pipeline of one stage per node would send over the link each way per update: the activations of
    this rank's samples at one stage boundary (0: the model cannot be pipelined)."""

    @property
    def bandwidth(self) -> float:
        """Bytes per second: gradient bytes over the all-reduce's time."""
        return self.gradient_bytes / max(self.all_reduce_seconds, 1e-9)

    @property
    def link(self) -> Link:
        """The link as the cost model (:mod:`hetfair.parallel.cost_model`) sees it: the bandwidth at which each rank
        sent its ring's ``2 (w - 1) / w`` of the buffer in the measured all-reduce; latency ignored (the advice is
        for bandwidth-bound runs)."""
        world = self.world_size
        return Link(2 * (world - 1) / world * self.bandwidth, 0.0)

    def outer_seconds(self, dtype: str) -> float:
        """Seconds of one outer-loop exchange of every parameter in ``dtype`` over :attr:`link`: the cost model's
        ring all-reduce in fp32, else each rank's packed bytes to every other
        (:func:`hetfair.parallel.outer_exchange.bytes_sent`)."""
        if dtype == "fp32":
            return all_reduce(self.link, 4 * self.parameters, self.world_size)
        return send_to_all(self.link, payload_bytes(self.parameters, dtype), self.world_size)

    def predicted_seconds(self, mode: str) -> float:
        """Seconds of one update's gradient communication in ``mode``: the cost model's all-reduce of the bytes the
        hook sends over :attr:`link` (so the measured time scaled by the hook's share, see the module)."""
        sent = next(hook.sent for hook in self.hooks if hook.name == mode)
        return all_reduce(self.link, sent * self.gradient_bytes, self.world_size)

    def pipeline_seconds(self) -> float:
        """Seconds the pipeline's activations (and, the other way, their gradients) take over :attr:`link`."""
        return send_to_all(self.link, self.boundary_bytes, 2)

    def gradient_bytes_sent(self) -> float:
        """Bytes each rank sends in the exact all-reduce: its ring's ``2 (w - 1) / w`` of the gradients."""
        return 2 * (self.world_size - 1) / self.world_size * self.gradient_bytes

    def is_lossy(self, mode: str) -> bool:
        return any(hook.lossy for hook in self.hooks if hook.name == mode)


@dataclass(frozen=True)
class CommAdvice:
    """The verdict on one run: bound or not, the mode that would help, the mode used from now on."""

    link: LinkMeasurement
    compute_seconds: float
    requested: str
    """``--ddp-comm-hook`` as given."""
    bound: bool
    suggested: str
    """``none`` when not bandwidth-bound, else the advised hook predicted fastest."""
    chosen: str
    """The mode that runs: ``suggested`` under ``auto``, else ``requested``."""
    kept: bool = False
    """``auto`` keeps the choice it made before a restart (``chosen``)."""
    notes: tuple[str, ...] = ()
    """What the hooks' ``auto`` settings chose (a ``comm |`` line each), before the verdict."""
    outer: Optional["OuterFit"] = None
    """Where no hook will do (:data:`OUTER_RATIO`): the outer loop's settings that fit the link."""

    def lines(self) -> list[str]:
        """Every ``comm |`` line: the hooks' choices, the verdict, where no hook will do the outer loop's, and
        where a pipeline would send fewer bytes than the gradients, the pipeline's."""
        return [*self.notes, self.line(), *([self.outer.line(self)] if self.outer is not None else []),
                *([self.pipeline_line()] if self.suggests_pipeline else [])]

    @property
    def suggests_pipeline(self) -> bool:
        """Bandwidth-bound, and a pipeline's activations are fewer bytes than the exact all-reduce sends."""
        link = self.link
        return self.bound and 0 < link.boundary_bytes < link.gradient_bytes_sent()

    def pipeline_line(self) -> str:
        """The ``comm |`` line that suggests a pipeline of one stage per node (exact, like the all-reduce)."""
        link = self.link
        return (f"comm | a pipeline of one stage per node would send {_megabytes(link.boundary_bytes)} each way per "
                f"update (the activations at a stage boundary, and their gradients back; ~"
                f"{milliseconds(link.pipeline_seconds())}) against the all-reduce's "
                f"{_megabytes(link.gradient_bytes_sent())}, and stay exact; try --ddp-backend pipeline "
                f"--pipeline-stages {link.nodes} in place of --ddp-comm-hook and its flags")

    def line(self) -> str:
        """The one ``comm |`` line."""
        link = self.link
        facts = (f"comm | {_megabytes(link.gradient_bytes)} of gradients per update | link "
                 f"{_megabytes(link.bandwidth)}/s | all-reduce {milliseconds(link.all_reduce_seconds)} vs compute "
                 f"{milliseconds(self.compute_seconds)} per update | ")
        return facts + self._verdict()

    def _verdict(self) -> str:
        bound = "bandwidth-bound" if self.bound else "not bandwidth-bound"
        if self.kept:
            return f"{bound}: auto keeps {self.named(self.chosen)}, its choice before the restart"
        if not self.bound:
            where = " (every rank on one node: no network link to spare)" if self.link.nodes == 1 else ""
            fits = f"not bandwidth-bound{where}: the exact all-reduce (none) fits"
            if self.requested == "auto":
                return fits + "; auto keeps it"
            return fits if self.chosen == EXACT else f"{fits}; this run uses {self.named(self.chosen)}"
        fastest = (f"{self.named(self.suggested)}, all-reduce "
                   f"~{milliseconds(self.link.predicted_seconds(self.suggested))}")
        if self.requested == "auto":
            return f"bandwidth-bound: auto switches on {fastest}"
        if self.chosen == self.suggested:
            return f"bandwidth-bound: this run uses the mode predicted fastest, {fastest}"
        return f"bandwidth-bound: --ddp-comm-hook {fastest} would help; this run uses {self.named(self.chosen)}"

    def named(self, mode: str) -> str:
        """``mode``, and ``(lossy)`` where it is."""
        return f"{mode} (lossy)" if self.link.is_lossy(mode) else mode


@dataclass(frozen=True)
class OuterFit:
    """The outer loop's settings for a link no hook will do: the smallest interval, then the least lossy
    dtype, whose exchange fits in the round's compute (:func:`fit_outer_loop`)."""

    interval: int
    dtype: str
    seconds: float
    """One round's exchange, predicted from the measured link."""
    fits: bool
    """It fits; else these are the settings that send least and wait least."""

    def flags(self) -> str:
        """The flags to run with instead of ``--ddp-comm-hook`` and its own."""
        return (f"--ddp-backend diloco --outer-interval {self.interval} --outer-fragments {OUTER_FRAGMENTS} "
                f"--outer-overlap --outer-reduce-dtype {self.dtype}")

    def line(self, advice: CommAdvice) -> str:
        """The ``comm |`` line that suggests them, after the verdict of ``advice``."""
        best = advice.link.predicted_seconds(advice.suggested)
        compute = advice.compute_seconds
        round_compute = self.interval * compute
        start = (f"comm | even {advice.named(advice.suggested)} takes ~{milliseconds(best)}, "
                 f"{best / compute:.3g}x an update's compute: ")
        if self.fits:
            middle = (f"the outer loop fits this link, its {self.dtype} exchange (~{milliseconds(self.seconds)}) "
                      f"running behind a round of {self.interval} updates (~{milliseconds(round_compute)} of compute)")
        else:
            middle = (f"even the outer loop's least ({self.dtype} every {self.interval} updates, "
                      f"~{milliseconds(self.seconds)}) outlasts a round's compute (~{milliseconds(round_compute)})")
        return f"{start}{middle}; try {self.flags()} in place of --ddp-comm-hook and its flags"


def fit_outer_loop(link: LinkMeasurement, compute_seconds: float) -> OuterFit:
    """The first of :data:`OUTER_INTERVALS` x :data:`OUTER_DTYPES` (interval first) whose predicted exchange
    (:meth:`LinkMeasurement.outer_seconds`) takes no longer than the round's compute, which it overlaps
    (``--outer-overlap``); where none does, the largest interval with the smallest dtype."""
    seconds = {dtype: link.outer_seconds(dtype) for dtype in OUTER_DTYPES}  # the same at every interval
    for interval in OUTER_INTERVALS:
        for dtype in OUTER_DTYPES:
            if seconds[dtype] <= interval * compute_seconds:
                return OuterFit(interval, dtype, seconds[dtype], True)
    return OuterFit(OUTER_INTERVALS[-1], OUTER_DTYPES[-1], seconds[OUTER_DTYPES[-1]], False)


def advise(link: LinkMeasurement, compute_seconds: float, requested: str, kept: Optional[str] = None,
           notes: tuple[str, ...] = ()) -> CommAdvice:
    """Apply the module's rule to the measurements; ``requested`` is ``--ddp-comm-hook``, ``kept`` the mode
    ``auto`` chose before a restart (restored from the checkpoint; it stays), ``notes`` the lines of what
    the hooks' ``auto`` settings chose."""
    bound = link.nodes > 1 and link.all_reduce_seconds >= BOUND_RATIO * compute_seconds
    suggested = _fastest(link) if bound else EXACT
    chosen = kept or (suggested if requested == "auto" else requested)
    no_hook_will_do = bound and link.predicted_seconds(suggested) >= OUTER_RATIO * compute_seconds
    outer = fit_outer_loop(link, compute_seconds) if no_hook_will_do else None
    return CommAdvice(link, compute_seconds, requested, bound, suggested, chosen, kept is not None, notes, outer)


def _fastest(link: LinkMeasurement) -> str:
    """The advised hook predicted fastest, the earlier of equals (``none`` where no hook may be advised)."""
    advised = [hook.name for hook in link.hooks if hook.advised]
    return min(advised, key=lambda mode: (link.predicted_seconds(mode), advised.index(mode)), default=EXACT)


class FittedHooks(Protocol):
    """The run's hooks as the advice sees them (:class:`hetfair.parallel.gradient_comm.GradientComm`)."""

    def fit_to_link(self, all_reduce_seconds: float, budget_seconds: float) -> list[str]:
        """Fit every ``auto`` setting of the hooks to the link; a ``comm |`` line for each choice."""

    def hook_costs(self) -> tuple[HookCost, ...]:
        """Each hook's cost, after the fitting."""


class CommAdvisor:
    """Waits for the compute time of update attempt :data:`ADVISE_AFTER`, then gives the advice once;
    ``hooks`` (where given) first fit their ``auto`` settings to a budget of :data:`BOUND_RATIO` of it."""

    def __init__(self, link: LinkMeasurement, requested: str, kept: Optional[str] = None,
                 hooks: Optional[FittedHooks] = None) -> None:
        self.link = link
        self.requested = requested
        self.kept = kept
        self.hooks = hooks
        self._timed = 0
        self.advice: Optional[CommAdvice] = None

    def observe(self, compute_seconds: list[float]) -> Optional[CommAdvice]:
        """Every update's per-rank compute seconds (as the trainer reports them, one update late, the same
        on every rank); the advice when it is due, else ``None``."""
        if self.advice is not None or not compute_seconds:
            return None
        self._timed += 1
        if self._timed < ADVISE_AFTER:
            return None
        compute, link, notes = max(compute_seconds), self.link, ()
        if self.hooks is not None:
            notes = tuple(self.hooks.fit_to_link(link.all_reduce_seconds, BOUND_RATIO * compute))
            link = replace(link, hooks=self.hooks.hook_costs())
        self.advice = advise(link, compute, self.requested, self.kept, notes)
        return self.advice


def _megabytes(count: float) -> str:
    return f"{count / 1e6:.3g} MB"


def milliseconds(seconds: float) -> str:
    """``seconds`` as ``12.3 ms``."""
    return f"{seconds * 1e3:.3g} ms"

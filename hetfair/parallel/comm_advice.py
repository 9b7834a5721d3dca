"""Pick by measurement: is a replicated run bandwidth-bound, and which ``--ddp-comm-hook`` would help?

At start-up one all-reduce of the gradients' size is timed (the slowest rank's time,
shared); the trainer measures each rank's compute seconds per update anyway. With
those, :func:`advise` applies the rule below, the same on every rank (every number
it reads is the same on every rank), and the run logs it in one ``comm |`` line.

The rule: the exact fp32 all-reduce of ``B`` bytes takes ``t`` (measured); a hook
that sends ``b`` bytes (its declared cost ``b / B``, :meth:`CommHook.sent_fraction`)
is predicted to take ``t * b / B`` (bandwidth-bound links: latency ignored). The run is
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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

BOUND_RATIO = 0.5
"""Bandwidth-bound: the exact all-reduce takes at least this share of an update's compute time."""

ADVISE_AFTER = 2
"""The compute time is that of the update attempt with this number (the first one's holds warm-up work)."""

EXACT = "none"
"""The exact all-reduce: the mode when not bandwidth-bound."""


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

    @property
    def bandwidth(self) -> float:
        """Bytes per second: gradient bytes over the all-reduce's time."""
        return self.gradient_bytes / max(self.all_reduce_seconds, 1e-9)

    def predicted_seconds(self, mode: str) -> float:
        """Seconds of one update's gradient communication in ``mode`` (bandwidth scaling, see the module)."""
        return self.all_reduce_seconds * next(hook.sent for hook in self.hooks if hook.name == mode)

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

    def line(self) -> str:
        """The one ``comm |`` line."""
        link = self.link
        facts = (f"comm | {_megabytes(link.gradient_bytes)} of gradients per update | link "
                 f"{_megabytes(link.bandwidth)}/s | all-reduce {_ms(link.all_reduce_seconds)} vs compute "
                 f"{_ms(self.compute_seconds)} per update | ")
        return facts + self._verdict()

    def _verdict(self) -> str:
        bound = "bandwidth-bound" if self.bound else "not bandwidth-bound"
        if self.kept:
            return f"{bound}: auto keeps {self._named(self.chosen)}, its choice before the restart"
        if not self.bound:
            where = " (every rank on one node: no network link to spare)" if self.link.nodes == 1 else ""
            fits = f"not bandwidth-bound{where}: the exact all-reduce (none) fits"
            if self.requested == "auto":
                return fits + "; auto keeps it"
            return fits if self.chosen == EXACT else f"{fits}; this run uses {self._named(self.chosen)}"
        fastest = f"{self._named(self.suggested)}, all-reduce ~{_ms(self.link.predicted_seconds(self.suggested))}"
        if self.requested == "auto":
            return f"bandwidth-bound: auto switches on {fastest}"
        if self.chosen == self.suggested:
            return f"bandwidth-bound: this run uses the mode predicted fastest, {fastest}"
        return f"bandwidth-bound: --ddp-comm-hook {fastest} would help; this run uses {self._named(self.chosen)}"

    def _named(self, mode: str) -> str:
        return f"{mode} (lossy)" if self.link.is_lossy(mode) else mode


def advise(link: LinkMeasurement, compute_seconds: float, requested: str, kept: Optional[str] = None) -> CommAdvice:
    """Apply the module's rule to the measurements; ``requested`` is ``--ddp-comm-hook``, ``kept`` the mode
    ``auto`` chose before a restart (restored from the checkpoint; it stays)."""
    bound = link.nodes > 1 and link.all_reduce_seconds >= BOUND_RATIO * compute_seconds
    suggested = _fastest(link) if bound else EXACT
    chosen = kept or (suggested if requested == "auto" else requested)
    return CommAdvice(link, compute_seconds, requested, bound, suggested, chosen, kept is not None)


def _fastest(link: LinkMeasurement) -> str:
    """The advised hook predicted fastest, the earlier of equals (``none`` where no hook may be advised)."""
    advised = [hook.name for hook in link.hooks if hook.advised]
    return min(advised, key=lambda mode: (link.predicted_seconds(mode), advised.index(mode)), default=EXACT)


class CommAdvisor:
    """Waits for the compute time of update attempt :data:`ADVISE_AFTER`, then gives the advice once."""

    def __init__(self, link: LinkMeasurement, requested: str, kept: Optional[str] = None) -> None:
        self.link = link
        self.requested = requested
        self.kept = kept
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
        self.advice = advise(self.link, max(compute_seconds), self.requested, self.kept)
        return self.advice


def _megabytes(count: float) -> str:
    return f"{count / 1e6:.3g} MB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"

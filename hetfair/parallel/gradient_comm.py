"""``--ddp-comm-hook``: the replicated strategy's DDP communicates its gradients through a registered
:class:`~hetfair.parallel.comm_hook.CommHook` (``none``: DDP's own exact all-reduce).

``auto`` runs the exact all-reduce until :mod:`hetfair.parallel.comm_advice` picks one of the
advised hooks; every hook it may switch on sees the buckets it does not communicate
(:meth:`CommHook.pass_over`), and each that keeps state is saved in the checkpoint's ``comm``
part, which also holds the hook asked for and the one in use.

On gloo, while the exact all-reduce is in use, the update's stats vector rides the first bucket's all-reduce
(:class:`~hetfair.parallel.stats.StatsCarrier`): a small gloo all-reduce of its own cost a 2-rank update of
a small model more than the model's own (docs/benchmarks.md, small-model overhead). The exact all-reduce is
then this Python hook on every bucket instead of DDP's C++ one: the same division by the world size before
the same sum, as torch's ``allreduce_hook``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hetfair.parallel.collectives import timed_all_reduce
from hetfair.parallel.comm_advice import HookCost
from hetfair.parallel.comm_hook import AUTO, EXACT, CommHook, hook_options, hooks_in_play
from hetfair.parallel.config import ParallelConfig
from hetfair.parallel.context import DistributedContext

class GradientComm:
    """How one replicated rank's DDP communicates its gradients: the hooks of ``--ddp-comm-hook``, their state,
    and the link measurement that :mod:`hetfair.parallel.comm_advice` reads."""

    def __init__(self, ddp: DistributedDataParallel, config: ParallelConfig, context: DistributedContext) -> None:
        self.context = context
        self.requested = config.ddp_comm_hook
        self.mode = EXACT if self.requested == AUTO else self.requested
        """The hook in use: ``auto`` communicates exactly until it has chosen."""
        self.params = list(ddp.module.parameters())
        given = dict(config.comm_options)
        in_play = hooks_in_play(self.requested)
        weighed = hooks_in_play(AUTO)
        self.hooks: dict[str, CommHook] = {name: hook(hook_options(hook, given), context, self.params)
                                           for name, hook in {**weighed, **in_play}.items()}
        """Every hook the advice weighs (the advised ones, the exact one) and the one asked for."""
        self.in_play = {name: self.hooks[name] for name in in_play}
        """The hooks that may communicate in this run, by name (those that keep state are saved)."""
        self.rides_stats = (EXACT in self.in_play and dist.get_backend() == "gloo"
                            and all(p.dtype == torch.float32 for p in self.params if p.requires_grad))
        """Whether the stats may ride the exact all-reduce (gloo, float32 buckets)."""
        self._stats: Optional[torch.Tensor] = None
        self._summed: Optional[torch.Tensor] = None
        if self.requested == AUTO or self.rides_stats:
            ddp.register_comm_hook(None, self._communicate)
        else:
            self.hooks[self.requested].register(ddp, self._communicate)

    # -- the hook -------------------------------------------------------------------
    def select(self, mode: str) -> None:
        """Communicate with ``mode`` from the next update on (``auto``'s choice; the same on every rank)."""
        self.mode = mode

    def _communicate(self, _state, bucket):  # type: ignore[no-untyped-def]
        """The registered hook (unannotated: DDP compares annotations with dist.GradBucket, and this module's
        are strings); ``bucket`` is a ``dist.GradBucket``, the result a ``Future`` of its reduced buffer."""
        active = self.hooks[self.mode]
        for hook in self.in_play.values():
            if hook is not active:
                hook.pass_over(bucket)
        if self._stats is not None and bucket.index() == 0:
            stats, self._stats = self._stats, None
            return self._ride(bucket, stats)
        return active.communicate(bucket)

    # -- the stats carried --------------------------------------------------------------
    def carry(self, vector: torch.Tensor) -> bool:
        """Send the float32 stats ``vector`` with the first bucket of the next backward, if the exact all-reduce is in
        use (the same on every rank)."""
        if not (self.rides_stats and self.mode == EXACT):
            return False
        self._stats, self._summed = vector, None
        return True

    def carried(self) -> Optional[torch.Tensor]:
        """The carried vector summed over ranks (``None``: no bucket all-reduce ran since :meth:`carry`)."""
        summed, self._summed, self._stats = self._summed, None, None
        return summed

    def _ride(self, bucket: dist.GradBucket, stats: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """The exact all-reduce of ``bucket`` with ``stats`` appended: the gradients divided by the world size first,
        as torch's ``allreduce_hook``; the stats summed."""
        buffer = bucket.buffer()
        buffer.div_(self.context.world_size)
        count = buffer.numel()

        def unpack(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            summed = future.value()[0]
            self._summed = summed[count:]
            buffer.copy_(summed[:count])
            return buffer

        joined = torch.cat([buffer, stats.to(buffer.device)])
        return dist.all_reduce(joined, async_op=True).get_future().then(unpack)

    def discard_update(self) -> None:
        """The update was dropped (an fp16 overflow): each hook forgets what it left in its state."""
        for hook in self.in_play.values():
            hook.discard_update()

    # -- checkpoint state -----------------------------------------------------------------
    @property
    def keeps_state(self) -> bool:
        """Whether a hook of this run has checkpoint state (the checkpoint's ``comm`` part)."""
        return any(hook.keeps_state for hook in self.in_play.values())

    def state_dict(self) -> dict[str, Any]:
        """A collective: on the master the hook asked for, the one in use and each stateful hook's state, else
        ``{}``."""
        states = [(name, hook.state_dict()) for name, hook in self.in_play.items() if hook.keeps_state]
        if not self.context.is_master:
            return {}
        merged: dict[str, Any] = {"hook": self.requested, "mode": self.mode}
        for name, state in states:
            clash = sorted(set(state) & set(merged))
            if clash:
                raise RuntimeError(f"comm hook '{name}' saves {', '.join(clash)}, which the comm part holds "
                                   "already; the hook must give its state keys of its own")
            merged.update(state)
        return merged

    def load_state_dict(self, state: dict[str, Any], notice: Callable[[str], None]) -> None:
        """Each stateful hook takes its part of a saved state (saying in one line where it cannot); ``auto``
        keeps its earlier choice where that hook continues."""
        if not state and self.requested == AUTO:
            return  # nothing saved, and auto may never use those hooks
        continued = {name for name, hook in self.in_play.items()
                     if not hook.keeps_state or hook.load_state_dict(state, notice)}
        if self.requested == AUTO and state.get("mode", EXACT) != EXACT and state["mode"] in continued:
            self.mode = state["mode"]

    # -- the link ---------------------------------------------------------------------
    def hook_costs(self) -> tuple[HookCost, ...]:
        """What the advice weighs of each hook: its bytes per update relative to the gradient's, whether it is
        lossy and whether it may be advised, in the advice's order of preference."""
        ordered = sorted(self.hooks.items(), key=lambda item: (type(item[1]).tie_order, item[0]))
        return tuple(HookCost(name, hook.sent_fraction(), hook.lossy, hook.advised) for name, hook in ordered)

    def fit_to_link(self, all_reduce_seconds: float, budget_seconds: float) -> list[str]:
        """Each hook fits its ``auto`` settings to the link (:meth:`CommHook.fit_link`); their ``comm |`` lines."""
        lines = (hook.fit_link(all_reduce_seconds, budget_seconds) for hook in self.hooks.values())
        return [line for line in lines if line is not None]

    @property
    def parameter_count(self) -> int:
        """Values of the trainable parameters."""
        return sum(p.numel() for p in self.params if p.requires_grad)

    @property
    def gradient_bytes(self) -> int:
        """Bytes of one rank's gradients: what the exact all-reduce sends per update."""
        return sum(p.numel() * p.element_size() for p in self.params if p.requires_grad)

    def time_all_reduce(self) -> float:
        """Seconds one all-reduce of the gradients' size takes, the slowest rank's (the same number on every rank)."""
        return timed_all_reduce(self.context, self.gradient_bytes // 4)


class CommStatePart:
    """The checkpoint part ``comm``: a :class:`GradientComm`'s hooks' state, each of which says in one line
    (``notice``) when it cannot continue from the checkpoint and starts afresh."""

    def __init__(self, comm: GradientComm, notice: Callable[[str], None]) -> None:
        self.comm = comm
        self.notice = notice
        self.loaded = False

    def state_dict(self) -> dict[str, Any]:
        return self.comm.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = True
        self.comm.load_state_dict(state, self.notice)

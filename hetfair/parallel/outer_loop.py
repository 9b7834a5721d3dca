"""``--ddp-backend localsgd`` and ``--ddp-backend diloco``: nodes train apart and meet every H updates.

Over a slow link, an all-reduce of every gradient costs more than the update. Here
each node (the processes one command, torchrun or SLURM starts on one machine)
runs ``--outer-interval H`` *inner* updates on its own: with one process per node
nothing leaves the process, with several their gradients are all-reduced inside
the node only (DDP over the node's process group). Then an *outer* step: every
rank's pseudo-gradient ``delta = anchor - parameters`` (the anchor: the parameters
at the start of the round) is averaged over all ranks, *weighted by samples*, and

- ``diloco`` (DiLoCo, Douillard et al. 2023) steps an outer SGD with Nesterov
  momentum (``--outer-lr``, default 0.7; ``--outer-momentum``, default 0.9, the
  paper's) on the anchor with that average as its gradient;
- ``localsgd`` takes the weighted average of the parameters, ``anchor - delta``
  (an outer SGD of learning rate 1 without momentum).

The anchor then becomes every rank's parameters. The weighting keeps hetfair's
update meaning: a node that took ``n_r`` of the round's ``N`` samples (a fast node
takes more: its batch size, or the balancer's split) counts ``n_r / N``:
``delta = sum_r n_r * delta_r / N``. Inner updates are normalised by the node's own
sample count, so each node's inner update is the mean gradient of its own samples.
With H = 1 and inner SGD, ``localsgd`` is therefore exactly the sample-weighted update
of ``c10d`` (and ``diloco`` that update under an outer Nesterov SGD).

The exchange is :mod:`hetfair.parallel.outer_exchange` (in fp32 the arithmetic of torch's
``model_averaging.utils.average_parameters``, given each rank's delta pre-scaled by
``n_r * world_size / N``), the outer optimizer ``torch.optim.SGD``. Not torchft's ``LocalSGD``/``DiLoCo``: they need torchft's ``Manager``, a
lighthouse server and its own reconfigurable process groups (fault tolerance
hetfair's launcher and elastic resume already cover), and they average uniformly,
so the sample weighting would need the same pre-scaling anyway.

Over a slow link the outer step can stream (Streaming DiLoCo, Douillard et al. 2025):
``--outer-fragments K`` splits the model into K fragments of about equal bytes
(:mod:`hetfair.parallel.outer_fragments`) that meet in turn, fragment ``k`` after
inner update ``(k + 1) H / K`` of each round, so the link carries 1/K of the model at a
time; ``--outer-overlap`` sends each fragment's pseudo-gradient in the background and
applies its outer step at the next meeting (``H / K`` inner updates later; one round for
K = 1) while the inner updates go on. The inner progress made meanwhile is kept: the
fragment becomes ``anchor' + (params_now - params_sent)``, so the next pseudo-gradient
holds exactly the inner steps since the last send. ``--outer-reduce-dtype`` packs the
pseudo-gradients as bf16, int8 or int4 with error feedback
(:mod:`hetfair.parallel.outer_exchange`). K = 1, no overlap and fp32 is plain DiLoCo, bit
for bit.

A round also ends early at the end of every epoch and before every validation and
save (one line says so the first time), so that the model validated and saved is
the one every rank holds. Checkpoints are therefore always at round boundaries (every
fragment met, nothing in flight): they hold the parameters (the anchor), the outer
optimizer's momentum, each rank's inner optimizer state (nodes' inner states differ) and,
with a lossy ``--outer-reduce-dtype``, each rank's error-feedback residual, so a resume is
exact.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar, ContextManager, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_flatten, tree_unflatten

from hetfair.parallel import cost_model, register_strategy
from hetfair.errors import ConfigError
from hetfair.parallel.collectives import all_gather_ints
from hetfair.parallel.config import ParallelConfig
from hetfair.parallel.context import DistributedContext
from hetfair.parallel.inner_steps import InnerStepCounts
from hetfair.parallel.outer_exchange import OuterExchange, PendingExchange
from hetfair.parallel.outer_fragments import split_fragments, sync_offsets
from hetfair.parallel.strategy import Strategy, refusal_of_backend

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL = 8
COST_INTERVALS = (8, 32)
"""``--outer-interval`` values the cluster plan weighs (:meth:`OuterLoopStrategy.cost_variants`)."""
COST_FRAGMENTS = 4
"""``--outer-fragments`` of the streaming variant it weighs."""
OUTER_STATE = "outer_loop"
"""The key, next to rank 0's plain optimizer state, of what the outer loop adds to a checkpoint."""


def node_ranks(context: DistributedContext) -> list[list[int]]:
    """The ranks of each node, nodes in order of their first rank: a node's processes have consecutive
    ranks from ``rank - local_rank`` (one command, torchrun's or SLURM's node)."""
    firsts = all_gather_ints(context, context.rank - context.local_rank)
    return [[rank for rank, first in enumerate(firsts) if first == node] for node in sorted(set(firsts))]


@dataclass
class _Fragment:
    """One fragment of the outer loop's parameters and where its round stands."""

    indices: list[int]
    """Its parameters' indices into the trainer's parameters (and the anchor)."""
    offset: int
    """The inner update of each round (1 to H) after which it meets."""
    exchange: OuterExchange
    samples: list[float]
    """Every rank's summed sample sizes since it last met (its weights ``n_r``), by rank."""
    updates: int = 0
    """Inner updates since it last met."""
    pending: Optional[PendingExchange] = None
    """Its exchange under way (``--outer-overlap``), applied at the next meeting."""
    sent: list[torch.Tensor] = field(default_factory=list)
    """Its parameters as they were sent (``--outer-overlap``): the base of the inner progress kept."""


class OuterLoopStrategy(Strategy):
    """Inner updates inside each node, an outer step across nodes every ``--outer-interval`` updates."""

    owned_flags = ("--outer-interval", "--outer-fragments", "--outer-overlap", "--outer-reduce-dtype",
                   "--inner-steps-by", "--find-unused-parameters", "--bucket-cap-mb")  # DDP inside each node
    outer_lr = 1.0
    outer_momentum = 0.0
    outer_state_copies: ClassVar[int] = 1
    """fp32 copies of the parameters the mode holds besides the model's (the anchor)."""

    @classmethod
    def cost_variants(cls, name: str, job: cost_model.Job) -> list[ParallelConfig]:
        """Across nodes only: each of :data:`COST_INTERVALS` plainly (fp32, one fragment) and streaming (int4,
        :data:`COST_FRAGMENTS` fragments, overlapped)."""
        if job.nodes < 2:
            return []
        return [config for interval in COST_INTERVALS for config in (
            ParallelConfig(name, outer_interval=interval),
            ParallelConfig(name, outer_interval=interval, outer_fragments=COST_FRAGMENTS, outer_overlap=True,
                           outer_reduce_dtype="int4"))]

    @classmethod
    def predict(cls, config: ParallelConfig, job: cost_model.Job) -> cost_model.UpdateCost:
        return cost_model.outer_loop(job, config.outer_interval or DEFAULT_INTERVAL, config.outer_reduce_dtype,
                                     config.outer_fragments, config.outer_overlap, cls.outer_state_copies)

    @classmethod
    def changes_numbers(cls, config: ParallelConfig, job: cost_model.Job) -> bool:
        return True  # nodes train apart between rounds

    @classmethod
    def check_options(cls, config: ParallelConfig) -> None:
        interval = config.outer_interval or DEFAULT_INTERVAL
        if config.outer_fragments > interval:
            raise ConfigError(f"--outer-fragments {config.outer_fragments} needs --outer-interval of at least "
                              f"{config.outer_fragments} (each fragment meets once a round), got {interval}")

    @classmethod
    def live_recovery_refusal(cls, config: ParallelConfig) -> Optional[str]:
        return refusal_of_backend(config, "the outer loop's rounds would need their own recovery")

    def __init__(self, config: ParallelConfig, context: DistributedContext) -> None:
        super().__init__(config, context)
        self.interval = config.outer_interval or DEFAULT_INTERVAL
        nodes = node_ranks(context)
        self.node = next(ranks for ranks in nodes if context.rank in ranks)
        self.node_group = _node_group(nodes, self.node) if context.is_distributed else None
        self.outer_group = dist.new_group(list(range(context.world_size))) \
            if context.is_distributed and config.outer_overlap else None
        """Background exchanges get a group of their own: nothing else queues behind them."""
        self.units: Sequence[nn.Module] = ()
        self.anchor: list[torch.Tensor] = []
        self.fragments: list[_Fragment] = []
        self.outer_optimizer: Optional[torch.optim.SGD] = None
        self.step_counts = InnerStepCounts(nodes) if config.inner_steps_by == "time" else None
        """``--inner-steps-by time``: each node's inner steps per update."""
        self.inner_updates = 0
        """Updates since the rounds began (the start, or the last :meth:`synchronize`)."""
        self._in_flight: Optional[_Fragment] = None
        self._cut_short_told = False

    # -- the model -------------------------------------------------------------------------
    def shard(self, model: nn.Module, units: Sequence[nn.Module]) -> None:
        """Nothing is sharded; the units are where fragments may be cut."""
        self.units = units

    def wrap(self, model: nn.Module) -> nn.Module:
        params = [p for p in model.parameters() if p.requires_grad]
        if self.context.is_distributed:
            _broadcast_from_rank_0(params)  # every node starts from the same parameters
        self.anchor = [p.detach().clone() for p in params]
        momentum = self.outer_momentum
        self.outer_optimizer = torch.optim.SGD(self.anchor, lr=self.outer_lr, momentum=momentum,
                                               nesterov=momentum > 0)
        world = self.context.world_size
        offsets = sync_offsets(self.interval, self.config.outer_fragments)
        self.fragments = [
            _Fragment(indices, offset, OuterExchange(self.config.outer_reduce_dtype,
                                                     sum(params[i].numel() for i in indices), self.context.device,
                                                     self.outer_group, world), [0.0] * world)
            for indices, offset in zip(split_fragments(params, self.units, self.config.outer_fragments), offsets)]
        if len(self.node) < 2:
            return model  # one process per node: its inner updates communicate nothing
        device = self.context.device
        return DistributedDataParallel(
            model, process_group=self.node_group,
            device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=self.config.find_unused_parameters,
            bucket_cap_mb=self.config.bucket_cap_mb, gradient_as_bucket_view=True)

    def gradient_sync(self, wrapped: nn.Module, is_last: bool) -> ContextManager[Any]:
        if is_last or not isinstance(wrapped, DistributedDataParallel):
            return nullcontext()
        return wrapped.no_sync()

    # -- one update -------------------------------------------------------------------------
    def normalising_factor(self, total_sample_size: float, rank_sample_sizes: Sequence[float]) -> float:
        """The node's own mean: DDP averaged over the node's ranks, so ``node size / node's samples``
        (0 for a node without samples in this update: it applies a zero gradient)."""
        node_samples = sum(rank_sample_sizes[rank] for rank in self.node)
        return len(self.node) / node_samples if node_samples > 0 else 0.0

    def inner_steps(self) -> Optional[Sequence[int]]:
        return None if self.step_counts is None else self.step_counts.counts

    def inner_normalising_factor(self, sample_size: float) -> float:
        """The node's own mean over one inner step's samples (summed over the node's ranks where it has several)."""
        node_samples = sample_size
        if self.node_group is not None:
            total = torch.tensor([sample_size], dtype=torch.float64)
            dist.all_reduce(total, group=self.node_group)
            node_samples = float(total.item())
        return len(self.node) / node_samples if node_samples > 0 else 0.0

    def observe_timings(self, seconds: Sequence[float]) -> None:
        if self.step_counts is not None:
            self.step_counts.observe(seconds)

    def agree_on_overflow(self, found_inf: torch.Tensor) -> None:
        """Nodes' gradients differ, and so may their overflow flags: all skip when one overflows, so the
        ranks keep counting the same updates."""
        if self.context.is_distributed:
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)

    def after_step(self, params: Sequence[nn.Parameter], rank_sample_sizes: Sequence[float]) -> None:
        """Count the inner update and its samples; a fragment whose turn it is meets."""
        self.inner_updates += 1
        position = (self.inner_updates - 1) % self.interval + 1
        for fragment in self.fragments:
            fragment.updates += 1
            fragment.samples = [mine + more for mine, more in zip(fragment.samples, rank_sample_sizes)]
        for fragment in self.fragments:
            if fragment.offset == position:
                self._meet(fragment, params, background=self.config.outer_overlap)
        if position == self.interval:
            self._recount_inner_steps()

    def synchronize(self, params: Sequence[nn.Parameter]) -> None:
        """End the round early (before a validation or save, at an epoch's end), if it has begun: every
        fragment meets, and nothing stays in flight."""
        cut_short = any(fragment.updates for fragment in self.fragments)
        if cut_short and not self._cut_short_told and self.context.is_master:
            position = self.inner_updates % self.interval
            logger.info(f"outer | a round ended after {position} of --outer-interval {self.interval} "
                        f"inner updates: rounds also end at epoch ends and before validating or saving, so that "
                        f"every rank holds the model validated and saved")
            self._cut_short_told = True
        self._finish_in_flight(params)
        for fragment in self.fragments:
            if fragment.updates:
                self._meet(fragment, params, background=False)
        if self.inner_updates % self.interval:
            self._recount_inner_steps()
        self.inner_updates = 0

    def _recount_inner_steps(self) -> None:
        """At a round boundary (``--inner-steps-by time``): the next round's inner steps per update, by node."""
        counts = self.step_counts.decide() if self.step_counts is not None else None
        if counts is not None:
            per_round = ", ".join(f"node {node} {count * self.interval}" for node, count in enumerate(counts))
            self._tell(f"outer | inner steps per round of {self.interval} updates by measured speed: {per_round} "
                       f"({' : '.join(map(str, counts))} per update, --inner-steps-by time)")

    @torch.no_grad()
    def _meet(self, fragment: _Fragment, params: Sequence[nn.Parameter], background: bool) -> None:
        """Send the fragment's pseudo-gradient (after applying the one in flight); apply it now unless in the
        ``background``."""
        self._finish_in_flight(params)
        own = [params[i].detach() for i in fragment.indices]
        deltas = torch._foreach_sub([self.anchor[i] for i in fragment.indices], own)
        fragment.pending = fragment.exchange.start(deltas, fragment.samples, self.context.rank, background)
        fragment.samples, fragment.updates = [0.0] * len(fragment.samples), 0
        if background:
            fragment.sent = [p.clone() for p in own]
            self._in_flight = fragment
        else:
            self._apply(fragment, params)

    def _finish_in_flight(self, params: Sequence[nn.Parameter]) -> None:
        if self._in_flight is not None:
            fragment, self._in_flight = self._in_flight, None
            self._apply(fragment, params)

    @torch.no_grad()
    def _apply(self, fragment: _Fragment, params: Sequence[nn.Parameter]) -> None:
        """The fragment's outer step: the ranks' sample-weighted mean pseudo-gradient into the outer SGD; its
        parameters become the new anchor (plus the inner progress since they were sent, in the background)."""
        assert self.outer_optimizer is not None and fragment.pending is not None
        anchors = [self.anchor[i] for i in fragment.indices]
        for anchor, delta in zip(anchors, fragment.pending.wait()):
            anchor.grad = delta
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)
        own = [params[i] for i in fragment.indices]
        if fragment.sent:
            torch._foreach_add_(own, torch._foreach_sub(anchors, fragment.sent))
        else:
            torch._foreach_copy_(own, anchors)
        fragment.pending, fragment.sent = None, []

    # -- checkpoint state -------------------------------------------------------------------
    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        model.load_state_dict(state)
        with torch.no_grad():  # a checkpoint is at a round boundary: its parameters are the anchor
            torch._foreach_copy_(self.anchor, [p.detach() for p in model.parameters() if p.requires_grad])

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                             params: Sequence[nn.Parameter]) -> Optional[dict[str, Any]]:
        """Rank 0's inner state in plain format (any mode can resume it), plus every rank's inner tensors
        (and error-feedback residuals) and the outer optimizer's state: a collective (the ranks' tensors are
        gathered to rank 0)."""
        assert self.outer_optimizer is not None
        state = optimizer.state_dict()
        tensors, _ = tree_flatten(state["state"])
        per_rank = _gather_to_rank_0(self.context, [t for t in tensors if isinstance(t, torch.Tensor)])
        residuals = [fragment.exchange.residual for fragment in self.fragments if fragment.exchange.residual.numel()]
        rank_residuals = _gather_to_rank_0(self.context, residuals) if residuals else []
        if not self.context.is_master:
            return None
        inner_steps = self.step_counts.state_dict() if self.step_counts is not None else None
        return {**state, OUTER_STATE: {"rank_tensors": per_rank, "outer": self.outer_optimizer.state_dict(),
                                       "rank_residuals": rank_residuals, "inner_steps": inner_steps}}

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  params: Sequence[nn.Parameter], state: dict[str, Any]) -> None:
        assert self.outer_optimizer is not None
        outer = state.get(OUTER_STATE)
        plain = {key: value for key, value in state.items() if key != OUTER_STATE}
        if outer is None:
            self._tell("restore | the checkpoint has no outer-loop state (another --ddp-backend wrote it): the "
                       "outer momentum starts at zero and every rank's inner optimizer from rank 0's state")
            optimizer.load_state_dict(plain)
            return
        self.outer_optimizer.load_state_dict(outer["outer"])
        for group in self.outer_optimizer.param_groups:  # the command line's outer settings, not the checkpoint's
            group.update(lr=self.outer_lr, momentum=self.outer_momentum, nesterov=self.outer_momentum > 0)
        self._load_residuals(outer.get("rank_residuals", []))
        self._load_inner_steps(outer.get("inner_steps"))
        per_rank = outer["rank_tensors"]
        if len(per_rank) != self.context.world_size:
            self._tell(f"restore | the checkpoint holds the inner optimizer states of {len(per_rank)} ranks, this "
                       f"run has {self.context.world_size}: every rank's inner state restarts from rank 0's")
            optimizer.load_state_dict(plain)
            return
        leaves, spec = tree_flatten(plain["state"])  # every rank's inner state has rank 0's structure
        own = iter(per_rank[self.context.rank])
        leaves = [next(own) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        optimizer.load_state_dict({**plain, "state": tree_unflatten(leaves, spec)})

    def _load_residuals(self, rank_residuals: list[list[torch.Tensor]]) -> None:
        """This rank's error-feedback residuals, where the checkpoint holds them for these fragments and ranks
        (else they start at zero: what they hold is at most one rounding step of each rank's delta)."""
        own = [fragment.exchange.residual for fragment in self.fragments if fragment.exchange.residual.numel()]
        saved = rank_residuals[self.context.rank] if len(rank_residuals) == self.context.world_size else []
        if own and [t.shape for t in saved] == [t.shape for t in own]:
            torch._foreach_copy_(own, saved)
        elif own:
            self._tell("restore | the checkpoint has no error-feedback residuals for these fragments and ranks "
                       "(another --outer-reduce-dtype, --outer-fragments or world size wrote it): they start at zero")

    def _load_inner_steps(self, state: Optional[dict[str, Any]]) -> None:
        """``--inner-steps-by time``: the checkpoint's inner steps per update, where it has them for these nodes."""
        if self.step_counts is None:
            return
        if state is not None and self.step_counts.load_state_dict(state):
            counts = self.step_counts.node_counts()
            if counts != [1] * len(counts):
                self._tell(f"restore | inner steps per update by node, from the checkpoint: "
                           f"{' : '.join(map(str, counts))} (--inner-steps-by time)")
            return
        self._tell("restore | the checkpoint has no inner step counts for these nodes (another --inner-steps-by or "
                   "world wrote it): every node starts at one per update until its speed is measured")

    def _tell(self, line: str) -> None:
        if self.context.is_master:
            logger.info(line)


@register_strategy("localsgd")
class LocalSGDStrategy(OuterLoopStrategy):
    """LocalSGD: every ``--outer-interval`` updates, the sample-weighted average of the parameters."""

    @classmethod
    def cost_variants(cls, name: str, job: cost_model.Job) -> list[ParallelConfig]:
        return []  # it costs what DiLoCo does; the plan weighs DiLoCo, closer to DDP's loss at the same interval


@register_strategy("diloco")
class DiLoCoStrategy(OuterLoopStrategy):
    """DiLoCo: every ``--outer-interval`` updates, an outer Nesterov SGD step on the sample-weighted mean
    pseudo-gradient."""

    owned_flags = (*OuterLoopStrategy.owned_flags, "--outer-lr", "--outer-momentum")
    outer_state_copies = 2  # the anchor and the outer momentum

    def __init__(self, config: ParallelConfig, context: DistributedContext) -> None:
        self.outer_lr = 0.7 if config.outer_lr is None else config.outer_lr
        self.outer_momentum = 0.9 if config.outer_momentum is None else config.outer_momentum
        super().__init__(config, context)


def _node_group(nodes: list[list[int]], own: list[int]) -> Optional[dist.ProcessGroup]:
    """This node's process group (every rank creates every node's group, as ``new_group`` requires)."""
    groups = {tuple(ranks): dist.new_group(ranks) for ranks in nodes if len(ranks) > 1}
    return groups.get(tuple(own))


def _broadcast_from_rank_0(params: Sequence[torch.Tensor]) -> None:
    """Rank 0's parameters on every rank, in one flat broadcast."""
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        dist.broadcast(flat, src=0)
        torch._foreach_copy_(list(params), [t.view_as(p) for t, p in zip(flat.split([p.numel() for p in params]),
                                                                          params)])


def _gather_to_rank_0(context: DistributedContext, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Every rank's ``tensors`` (alike in shapes and dtypes on every rank) on rank 0, indexed by rank;
    empty elsewhere. One gather per dtype of flat tensors, not pickled objects: no rank unpickles what a
    peer sends."""
    if not context.is_distributed:
        return [tensors]
    gathered: list[list[Optional[torch.Tensor]]] = [[None] * len(tensors) for _ in range(context.world_size)]
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        indices = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in indices])
        buckets = [torch.empty_like(flat) for _ in range(context.world_size)] if context.is_master else None
        dist.gather(flat, buckets, dst=0)
        for rank, bucket in enumerate(buckets or []):
            pieces = bucket.split([tensors[i].numel() for i in indices])
            for i, piece in zip(indices, pieces):
                gathered[rank][i] = piece.view_as(tensors[i]).clone()
    return gathered if context.is_master else []  # type: ignore[return-value]

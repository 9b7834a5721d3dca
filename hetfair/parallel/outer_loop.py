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

Built on torch's ``torch.distributed.algorithms.model_averaging.utils.average_parameters``
(one flat all-reduce of the tensors, divided by the world size), given each rank's
delta pre-scaled by ``n_r * world_size / N``, and on ``torch.optim.SGD`` as the outer
optimizer. Not torchft's ``LocalSGD``/``DiLoCo``: they need torchft's ``Manager``, a
lighthouse server and its own reconfigurable process groups (fault tolerance
hetfair's launcher and elastic resume already cover), and they average uniformly,
so the sample weighting would need the same pre-scaling anyway.

A round also ends early at the end of every epoch and before every validation and
save (one line says so the first time), so that the model validated and saved is
the one every rank holds. Checkpoints are therefore always at round boundaries:
they hold the parameters (the anchor), the outer optimizer's momentum and each rank's
inner optimizer state (nodes' inner states differ), so a resume is exact.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any, ContextManager, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.model_averaging.utils import average_parameters
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_flatten, tree_unflatten

from hetfair.parallel import register_strategy
from hetfair.parallel.collectives import all_gather_ints
from hetfair.parallel.config import ParallelConfig
from hetfair.parallel.context import DistributedContext
from hetfair.parallel.strategy import Strategy, refusal_of_backend

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL = 8
OUTER_STATE = "outer_loop"
"""The key, next to rank 0's plain optimizer state, of what the outer loop adds to a checkpoint."""


def node_ranks(context: DistributedContext) -> list[list[int]]:
    """The ranks of each node, nodes in order of their first rank: a node's processes have consecutive
    ranks from ``rank - local_rank`` (one command, torchrun's or SLURM's node)."""
    firsts = all_gather_ints(context, context.rank - context.local_rank)
    return [[rank for rank, first in enumerate(firsts) if first == node] for node in sorted(set(firsts))]


class OuterLoopStrategy(Strategy):
    """Inner updates inside each node, an outer step across nodes every ``--outer-interval`` updates."""

    owned_flags = ("--outer-interval", "--find-unused-parameters", "--bucket-cap-mb")  # DDP inside each node
    outer_lr = 1.0
    outer_momentum = 0.0

    @classmethod
    def live_recovery_refusal(cls, config: ParallelConfig) -> Optional[str]:
        return refusal_of_backend(config, "the outer loop's rounds would need their own recovery")

    def __init__(self, config: ParallelConfig, context: DistributedContext) -> None:
        super().__init__(config, context)
        self.interval = config.outer_interval or DEFAULT_INTERVAL
        nodes = node_ranks(context)
        self.node = next(ranks for ranks in nodes if context.rank in ranks)
        self.node_group = _node_group(nodes, self.node) if context.is_distributed else None
        self.anchor: list[torch.Tensor] = []
        self.outer_optimizer: Optional[torch.optim.SGD] = None
        self.inner_updates = 0
        """Inner updates of the current round."""
        self.rank_samples = 0.0
        """This rank's summed sample sizes of the round (its weight ``n_r``)."""
        self.round_samples = 0.0
        """All ranks' summed sample sizes of the round (``N``)."""
        self._cut_short_told = False

    # -- the model -------------------------------------------------------------------------
    def wrap(self, model: nn.Module) -> nn.Module:
        params = [p for p in model.parameters() if p.requires_grad]
        if self.context.is_distributed:
            _broadcast_from_rank_0(params)  # every node starts from the same parameters
        self.anchor = [p.detach().clone() for p in params]
        momentum = self.outer_momentum
        self.outer_optimizer = torch.optim.SGD(self.anchor, lr=self.outer_lr, momentum=momentum,
                                               nesterov=momentum > 0)
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

    def agree_on_overflow(self, found_inf: torch.Tensor) -> None:
        """Nodes' gradients differ, and so may their overflow flags: all skip when one overflows, so the
        ranks keep counting the same updates."""
        if self.context.is_distributed:
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)

    def after_step(self, params: Sequence[nn.Parameter], rank_sample_sizes: Sequence[float]) -> None:
        """Count the inner update and its samples; the H-th ends the round."""
        self.inner_updates += 1
        self.rank_samples += rank_sample_sizes[self.context.rank]
        self.round_samples += sum(rank_sample_sizes)
        if self.inner_updates == self.interval:
            self._end_round(params)

    def synchronize(self, params: Sequence[nn.Parameter]) -> None:
        """End the round early (before a validation or save, at an epoch's end), if it has begun."""
        if self.inner_updates == 0:
            return
        if not self._cut_short_told and self.context.is_master:
            logger.info(f"outer | a round ended after {self.inner_updates} of --outer-interval {self.interval} "
                        f"inner updates: rounds also end at epoch ends and before validating or saving, so that "
                        f"every rank holds the model validated and saved")
            self._cut_short_told = True
        self._end_round(params)

    @torch.no_grad()
    def _end_round(self, params: Sequence[nn.Parameter]) -> None:
        """The outer step: the sample-weighted mean of the ranks' pseudo-gradients into the outer SGD."""
        assert self.outer_optimizer is not None
        deltas = torch._foreach_sub(self.anchor, [p.detach() for p in params])
        weight = self.rank_samples * self.context.world_size / self.round_samples if self.round_samples else 0.0
        torch._foreach_mul_(deltas, weight)
        if self.context.is_distributed:
            average_parameters(iter(deltas), dist.group.WORLD)  # in place: sum over ranks / world size
        for anchor, delta in zip(self.anchor, deltas):
            anchor.grad = delta
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)
        for param, anchor in zip(params, self.anchor):
            param.copy_(anchor)
        self.inner_updates, self.rank_samples, self.round_samples = 0, 0.0, 0.0

    # -- checkpoint state -------------------------------------------------------------------
    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        model.load_state_dict(state)
        with torch.no_grad():  # a checkpoint is at a round boundary: its parameters are the anchor
            torch._foreach_copy_(self.anchor, [p.detach() for p in model.parameters() if p.requires_grad])

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                             params: Sequence[nn.Parameter]) -> Optional[dict[str, Any]]:
        """Rank 0's inner state in plain format (any mode can resume it), plus every rank's inner tensors
        and the outer optimizer's state: a collective (the ranks' tensors are gathered to rank 0)."""
        assert self.outer_optimizer is not None
        state = optimizer.state_dict()
        tensors, _ = tree_flatten(state["state"])
        per_rank = _gather_to_rank_0(self.context, [t for t in tensors if isinstance(t, torch.Tensor)])
        if not self.context.is_master:
            return None
        return {**state, OUTER_STATE: {"rank_tensors": per_rank, "outer": self.outer_optimizer.state_dict()}}

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

    def _tell(self, line: str) -> None:
        if self.context.is_master:
            logger.info(line)


@register_strategy("localsgd")
class LocalSGDStrategy(OuterLoopStrategy):
    """LocalSGD: every ``--outer-interval`` updates, the sample-weighted average of the parameters."""


@register_strategy("diloco")
class DiLoCoStrategy(OuterLoopStrategy):
    """DiLoCo: every ``--outer-interval`` updates, an outer Nesterov SGD step on the sample-weighted mean
    pseudo-gradient."""

    owned_flags = (*OuterLoopStrategy.owned_flags, "--outer-lr", "--outer-momentum")

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

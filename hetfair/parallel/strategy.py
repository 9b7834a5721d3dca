"""The :class:`Strategy` base: how a run spreads its model, gradients and state over the ranks.

The trainer, the validator and the checkpoint call these operations and never ask
which mode runs; a mode is one subclass in a file of its own, registered in
:data:`hetfair.parallel.STRATEGY_REGISTRY` under the name ``--ddp-backend`` gives.
The base class is the single-process behaviour (every tensor local and full, no
communication), so a subclass overrides only what its mode changes. What the rest of
hetfair needs to know about a mode (live recovery, ``--compile``, the plan's candidates,
the memory plan, the flags it owns) it asks the class (``live_recovery_refusal``,
``compile_refusal``, ``plan_role``, ``takes_shard_fractions``, ``takes_shard_weights``,
``owned_flags``), never the name (``tests/test_strategy_capabilities.py`` checks).
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, ClassVar, ContextManager, Literal, Optional, Sequence

import torch
from torch import nn

from hetfair.parallel.context import DistributedContext
from hetfair.parallel.config import ParallelConfig

if TYPE_CHECKING:
    from hetfair.optim import HetfairOptimizer
    from hetfair.parallel.cost_model import Job, UpdateCost
    from hetfair.parallel.gradient_comm import GradientComm
    from hetfair.parallel.pipeline import PipelineRun

PlanRole = Literal["replicated", "sharded"]
"""The parts ``--ddp-backend auto`` chooses a mode for (:attr:`Strategy.plan_role`)."""
PLAN_ROLES: tuple[PlanRole, ...] = ("replicated", "sharded")


def refusal_of_backend(config: ParallelConfig, why: str) -> str:
    """A :meth:`Strategy.live_recovery_refusal` of the whole mode ``config`` names: ``why``, and what to run instead."""
    return (f"--ddp-backend {config.ddp_backend}: {why}; use --ddp-backend c10d, or --fault-tolerance none with "
            f"torchrun's restarts")


class Strategy:
    """One parallelism mode of one process: built from the run's :class:`ParallelConfig` and its rank."""

    owned_flags: ClassVar[tuple[str, ...]] = ()
    """The flags that mean something only in this mode (and the others that own them): given with another
    ``--ddp-backend``, they are refused at option parsing (:func:`hetfair.options.check_owned_flags`)."""
    compile_refusal: ClassVar[Optional[str]] = None
    """Why ``--compile`` cannot trace the mode's model, as the one-line error the trainer gives (``None``: it can)."""
    takes_shard_fractions: ClassVar[bool] = False
    """Whether the mode splits its state by :attr:`ParallelConfig.shard_fractions` (then budgets fill them in)."""
    plan_role: ClassVar[Optional[PlanRole]] = None
    """What ``--ddp-backend auto`` may choose the mode as (:func:`hetfair.parallel.plan_candidate`): ``"replicated"``
    when every rank holds the model's whole state and a micro-batch (the ``plan |`` table shows ``whole``),
    ``"sharded"`` when one does not (the state split in proportion to the budgets: it needs
    :attr:`takes_shard_fractions`); ``None``: never chosen."""

    def __init__(self, config: ParallelConfig, context: DistributedContext) -> None:
        self.check_world(config, context.world_size)
        self.config = config
        self.context = context

    # -- checks, before any compute ---------------------------------------------------
    @classmethod
    def check_options(cls, config: ParallelConfig) -> None:
        """Refuse flags this mode cannot honour (a :class:`~hetfair.errors.ConfigError`); at option parsing."""

    @classmethod
    def check_world(cls, config: ParallelConfig, world_size: int) -> None:
        """Refuse a world size this mode cannot run on; before any process starts."""

    @classmethod
    def live_recovery_refusal(cls, config: ParallelConfig) -> Optional[str]:
        """Why ``--fault-tolerance live`` cannot keep a run of this mode with ``config`` exact: the part of its
        one-line error after "does not support" (``None``: it can, as here, every rank holding the whole state).
        :func:`refusal_of_backend` words one for a whole mode."""
        return None

    @classmethod
    def takes_shard_weights(cls, config: ParallelConfig) -> bool:
        """Whether, with ``config``, the mode splits its optimizer state by :attr:`ParallelConfig.zero_shard_weights`
        (then budgets fill them in, :func:`hetfair.memory.plan.complete_parallel_config`)."""
        return False

    @classmethod
    def wants_rank_speeds(cls, config: ParallelConfig) -> bool:
        """Whether the mode sizes its parts by each rank's measured speed and budget
        (:attr:`ParallelConfig.rank_speeds`, filled in at start-up before the model is sharded)."""
        return False

    @classmethod
    def data_groups(cls, config: ParallelConfig, world_size: int) -> list[list[int]]:
        """The ranks that load the same samples, group by group (each group one share of every step, the groups
        in the order the batch plan shares to them): here each rank alone."""
        return [[rank] for rank in range(world_size)]

    @classmethod
    def variant(cls, config: ParallelConfig) -> type["Strategy"]:
        """The class that runs this mode with ``config`` (a mode may have more than one engine)."""
        return cls

    # -- the cluster plan's cost model (hetfair.parallel.cost_model) ---------------------------
    @classmethod
    def cost_variants(cls, name: str, job: "Job") -> list[ParallelConfig]:
        """The settings of this mode (registered as ``name``) the cluster plan weighs for ``job``; ``[]``: none (the
        mode cannot run there, or has no formula), as here."""
        return []

    @classmethod
    def predict(cls, config: ParallelConfig, job: "Job") -> "UpdateCost":
        """One update of ``job`` in this mode with ``config`` (one of :meth:`cost_variants`): the mode's formula in
        :mod:`hetfair.parallel.cost_model`."""
        raise NotImplementedError(f"{cls.__name__} has no cost formula")

    @classmethod
    def changes_numbers(cls, config: ParallelConfig, job: "Job") -> bool:
        """Whether the mode's update differs from plain data parallelism's beyond float rounding (lossy)."""
        return False

    @classmethod
    def builds_deferred(cls, config: ParallelConfig) -> bool:
        """Whether the run builds its model on the meta device (:func:`hetfair.models.deferred_init.build_deferred`):
        :meth:`shard` then materialises only this rank's part of each tensor, so no rank holds the whole model."""
        return False

    # -- the model and the optimizer ----------------------------------------------------------
    def shard(self, model: nn.Module, units: Sequence[nn.Module]) -> None:
        """Split ``model`` over the ranks in place, before it moves to the device; ``units`` are its own
        sharding units (:meth:`~hetfair.models.HetfairModel.sharding_units`). A deferred model (where
        :meth:`builds_deferred`) arrives on the meta device and leaves with values."""

    def to_device(self, model: nn.Module) -> nn.Module:
        """``model`` (sharded already) on this process's device: what of it computes there."""
        return model.to(self.context.device)

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module forward passes run through (``model`` on its device, compiled if asked)."""
        return model

    def build_optimizer(self, recipe: type["HetfairOptimizer"], args: argparse.Namespace,
                        params: list[nn.Parameter]) -> torch.optim.Optimizer:
        """``recipe``'s optimizer over ``params`` (its flags in ``args``)."""
        return recipe.build(args, params)

    # -- one update -------------------------------------------------------------------------
    @property
    def joins_every_micro_batch(self) -> bool:
        """Whether a rank without samples must still run every micro-batch (and every validation batch):
        its forward or backward holds collectives the other ranks run. Otherwise only the last one."""
        return False

    @property
    def holds_full_gradients(self) -> bool:
        """Whether every rank holds the whole reduced gradient after the backward (not a shard of it)."""
        return True

    def micro_batches_per_step(self) -> int:
        """The micro-batches this rank's share of each step is cut into (here one: ``--update-freq`` adds steps)."""
        return 1

    def micro_batch_runner(self) -> Optional["PipelineRun"]:
        """Where the mode runs an update's micro-batches itself (a pipeline's schedule), what runs them;
        ``None`` (here): the trainer runs each micro-batch's forward and backward."""
        return None

    def gradient_sync(self, wrapped: nn.Module, is_last: bool) -> ContextManager[Any]:
        """The context of one micro-batch's forward and backward: gradients are reduced in the last one only."""
        return nullcontext()

    def discard_update(self) -> None:
        """This update's reduced gradients are dropped (an fp16 overflow, on every rank alike)."""

    def gradient_comm(self) -> Optional["GradientComm"]:
        """The gradient communication to measure and advise on (``comm |``), where the mode has one."""
        return None

    def local_tensors(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's part of each of ``tensors``, for in-place arithmetic."""
        return list(tensors)

    def agree_on_overflow(self, found_inf: torch.Tensor) -> None:
        """Make ``found_inf`` (this rank's inf/NaN flag, 0 or 1) the same on every rank, in place."""

    def normalising_factor(self, total_sample_size: float, rank_sample_sizes: Sequence[float]) -> float:
        """What the reduced gradients are multiplied by so that they are the mean over the update's samples:
        ``world_size / total_sample_size`` (the gradient all-reduce averaged over the ranks).
        ``rank_sample_sizes``: every rank's sample size of the update, indexed by rank."""
        return self.context.world_size / total_sample_size

    def after_step(self, params: Sequence[nn.Parameter], rank_sample_sizes: Sequence[float]) -> None:
        """Called after each applied optimizer step, with every rank's sample size of the update."""

    def inner_steps(self) -> Optional[Sequence[int]]:
        """Every rank's optimizer steps per update, by rank, where they may differ and exceed one (an outer
        loop's ``--inner-steps-by time``): each rank's micro-batches are then cut into that many equal groups,
        each group one step normalised by :meth:`inner_normalising_factor`. ``None``: one step, by
        :meth:`normalising_factor`."""
        return None

    def inner_normalising_factor(self, sample_size: float) -> float:
        """Where :meth:`inner_steps` is not ``None``: what one step's reduced gradients are multiplied by, given
        this rank's ``sample_size`` of that step."""
        raise NotImplementedError(f"{type(self).__name__} takes one step per update")

    def observe_timings(self, seconds: Sequence[float]) -> None:
        """Every rank's compute seconds of an earlier update (they travel one update late), by rank."""

    def synchronize(self, params: Sequence[nn.Parameter]) -> None:
        """Make the parameters the same on every rank, before they are validated or saved (here they always are)."""

    def clip_grad_norm(self, params: Sequence[nn.Parameter], grads: list[torch.Tensor], owed: float,
                       clip_norm: float) -> tuple[float, float]:
        """The global norm of the normalised gradients ``owed * grads``, and the multiplier they still need:
        ``owed`` times the clipping coefficient (``clip_norm > 0``, computed as ``clip_grad_norm_`` does)."""
        if not grads:
            return 0.0, owed
        gnorm = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))) * owed
        if clip_norm > 0:
            return gnorm, owed * min(1.0, clip_norm / (gnorm + 1e-6))
        return gnorm, owed

    # -- checkpoint state ---------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full model state, complete on the master (a collective where the model is sharded)."""
        return model.state_dict()

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load a full model state (present on every rank); each rank keeps its part."""
        model.load_state_dict(state)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                             params: Sequence[nn.Parameter]) -> Optional[dict[str, Any]]:
        """The full optimizer state in plain ``torch.optim`` format on the master, ``None`` elsewhere
        (a collective where the state is sharded)."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  params: Sequence[nn.Parameter], state: dict[str, Any]) -> None:
        """Load a full, plain-format optimizer state (present on every rank); each rank keeps its part."""
        optimizer.load_state_dict(state)

    def held_state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """The bytes of training state this rank holds: its (part of the) ``params``, their ``grads`` and the
        ``optimizer`` state."""
        params = [param for group in optimizer.param_groups for param in group["params"]]
        grads = [param.grad for param in params if param.grad is not None]
        state = [value for values in optimizer.state.values() for value in values.values()
                 if isinstance(value, torch.Tensor)]
        return {kind: sum(t.numel() * t.element_size() for t in self.local_tensors(tensors))
                for kind, tensors in (("params", params), ("grads", grads), ("optimizer", state))}

    def largest_gathered_unit_bytes(self) -> int:
        """The parameter bytes of the largest unit gathered whole for compute (0: the whole model is held)."""
        return 0

    def plan_lines(self, caps: Sequence[int]) -> list[str]:
        """Lines for the ``plan |`` table about how the mode split the model (``caps``: each data group's
        micro-batch, :meth:`data_groups`); here none."""
        return []

    def shard_report(self, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        """Per-rank sizes worth logging once after the first update (a collective where there are any)."""
        return {}

    # -- memory ---------------------------------------------------------------------------------
    def state_shares(self, rank: int) -> tuple[float, float]:
        """The share of the full state that ``rank`` keeps: of the parameters and gradients, and of the
        optimizer state (here 1 and 1: every rank holds everything)."""
        return 1.0, 1.0

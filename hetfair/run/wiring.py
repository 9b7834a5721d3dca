"""The run's wiring: the one place below the command line that reads the options namespace.

Components (task, model, criterion, optimizer, lr scheduler) are plugins built from their own flags,
fairseq-style (``setup_task(args)``, ``build_model(args)``, ``build(args, params)``): they get the
namespace here. Everything else gets the typed sections of one :class:`~hetfair.run.config.RunConfig`,
built here once and replaced by the plan's (every ``auto`` chosen). The checkpoint keeps the planned
options as plain data (:func:`hetfair.options.plain_config`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from hetfair.criteria.fit import check_criterion_fits
from hetfair.data.rank_batches import dummy_batch
from hetfair.models import HetfairModel
from hetfair.models.deferred_init import build_deferred
from hetfair.optim import LR_SCHEDULER_REGISTRY, OPTIMIZER_REGISTRY
from hetfair.options import plain_config
from hetfair.parallel import STRATEGY_REGISTRY, ParallelConfig, build_strategy
from hetfair.parallel.context import DistributedContext
from hetfair.parallel.cost_model import ModelCost
from hetfair.plan.measure import SAMPLES, STEPS, step_seconds
from hetfair.plan.model_cost import measure_model_cost
from hetfair.plan.planner import JobPlan, Planner, plan_probes
from hetfair.plan.probe import longest_sample_batches
from hetfair.plan.state import OptimizerFactory, optimizer_state_ratio
from hetfair.precision.auto import resolved_precision
from hetfair.precision.mixed import LossScaler
from hetfair.rng import seed_everything
from hetfair.run.config import RunConfig
from hetfair.tasks import TASK_REGISTRY, Task
from hetfair.trainer import Trainer, TrainerConfig


@dataclass
class Components:
    """What the task builds before the plan: the training data, the model, the criterion and a dummy batch."""

    task: Task
    train_data: Any
    model: torch.nn.Module
    criterion: torch.nn.Module
    dummy: dict[str, Any]

    @property
    def deferred(self) -> bool:
        """The model has no values until the strategy shards it (built on the meta device)."""
        return any(param.is_meta for param in self.model.parameters())


class RunWiring:
    """Builds one process's run from its options: the components, the plan's :class:`RunConfig`, the trainer.

    ``--precision auto`` is resolved for ``context``'s device first, so that every component sees the
    precision this process trains in.
    """

    def __init__(self, args: argparse.Namespace, context: DistributedContext) -> None:
        self._args = argparse.Namespace(**{**vars(args), "precision": resolved_precision(args.precision,
                                                                                           context.device)})
        self.context = context
        self.config = RunConfig.from_args(self._args, context.world_size, balance_lag=Trainer.TIMINGS_LAG)
        """The run's configuration; after :meth:`plan` the plan's, every ``auto`` replaced."""

    def build_components(self) -> Components:
        """Seed, set the task up and build its training data, model (see :meth:`_build_model`) and criterion;
        a model with values is checked against the criterion at once."""
        args = self._args
        seed_everything(args.seed)
        task = TASK_REGISTRY.get(args.task).setup_task(args)
        train_data = task.dataset(args.train_subset)
        model = self._build_model(task)
        components = Components(task, train_data, model, task.build_criterion(args),
                                dummy_batch(train_data, task.collater))
        if not components.deferred:
            self.check_criterion(model, components.criterion, components.dummy)
        return components

    def _build_model(self, task: Task) -> torch.nn.Module:
        """The task's model; on the meta device where the strategy materialises only its rank's shards
        (not where the plan probes micro-batches or the backend on the whole model)."""
        parallel = self.config.parallel
        if not plan_probes(self.config, self.context.world_size):
            if STRATEGY_REGISTRY.get(parallel.ddp_backend).builds_deferred(parallel):
                return build_deferred(lambda: task.build_model(self._args))
        return task.build_model(self._args)

    def check_criterion(self, model: torch.nn.Module, criterion: torch.nn.Module, dummy: dict[str, Any]) -> None:
        """A mismatch of criterion and task is one error line (a trial forward on one sample)."""
        names = {"criterion": self._args.criterion, "task": self._args.task, "arch": self._args.arch}
        check_criterion_fits(model, criterion, dummy, names)

    def plan(self, components: Components) -> JobPlan:
        """The job's plan (probing this rank's micro-batch where it is ``auto``; a collective); :attr:`config`
        and the options the components and the checkpoint see become the plan's."""
        batch_of, units, build_optimizer = self._plan_inputs(components)
        planner = Planner(self.config, self.context, components.model, components.criterion, batch_of,
                          len(components.train_data), components.task.max_positions(), units, build_optimizer)
        plan, planned = planner.plan()
        self._args = planned_options(self._args, self.config, planned)
        self.config = planned
        return plan

    def model_cost(self, components: Components) -> ModelCost:
        """What the model costs on any device, for the cluster plan (:mod:`hetfair.plan.model_cost`)."""
        batch_of, units, build_optimizer = self._plan_inputs(components)
        return measure_model_cost(components.model, components.criterion, batch_of, units, build_optimizer)

    def samples_per_second(self, components: Components, samples: int = 2 * SAMPLES, steps: int = STEPS) -> float:
        """This rank's samples per second through the whole model, forward and backward, on steps of ``samples``
        (default 16) of the task's longest samples timed as the cluster plan times a device
        (:func:`hetfair.plan.measure.step_seconds`: the mean of ``steps``, default 3, after one untimed). One size,
        not the plan's difference of two: a speed to compare ranks by needs no split of the per-update overhead, and a
        difference of two timings is the noisier (under a CPU quota, the one rank with half the CPU measured faster
        than the other)."""
        batch_of, _units, _build = self._plan_inputs(components)
        seconds = step_seconds(components.model, components.criterion, batch_of(samples), self.context.device,
                               self.config.precision.precision, steps)
        return samples / seconds

    def _plan_inputs(self, components: Components) -> tuple[Callable[[int], dict[str, Any]], list[torch.nn.Module],
                                                            OptimizerFactory]:
        """The plans' view of the model: ``n`` -> a batch of ``n`` of its largest samples, its sharding units, and
        how its optimizer is built."""
        model, task = components.model, components.task
        units = model.sharding_units() if isinstance(model, HetfairModel) else []
        recipe = OPTIMIZER_REGISTRY.get(self._args.optimizer)
        return (longest_sample_batches(components.train_data, task.collater), list(units),
                lambda params: recipe.build(self._args, params))

    def build_trainer(self, components: Components, loss_scaler: Optional[LossScaler],
                      parallel: ParallelConfig) -> Trainer:
        """The trainer of the planned run, on the job's ``parallel`` settings (see :func:`build_trainer`)."""
        return build_trainer(self._args, components.model, components.criterion, self.context, components.dummy,
                             loss_scaler, parallel)

    def optimizer_state_ratio(self) -> float:
        """The optimizer's state per byte of parameters, measured on a stand-in."""
        recipe = OPTIMIZER_REGISTRY.get(self._args.optimizer)
        return optimizer_state_ratio(lambda params: recipe.torch_class(params, **recipe.torch_kwargs(self._args)))

    def stored_options(self) -> dict[str, Any]:
        """The options the checkpoint keeps, as plain data (the plan's choices in place of ``auto``)."""
        return plain_config(self._args)

    def model_description(self) -> str:
        """``model bert (arch bert_base) | task masked_lm`` for the ``setup |`` line; where BERT's
        ``--init-from-hf`` directory or ``--config_file`` decides the size, that in place of ``--arch``."""
        args = self._args
        init_from, config_file = getattr(args, "init_from_hf", None), getattr(args, "config_file", None)
        shape = f"init-from-hf {init_from}" if init_from else f"config {config_file}" if config_file else \
            f"arch {args.arch}"
        return f"model {args.model} ({shape}) | task {args.task}"

    def scheduled_updates(self) -> int:
        """The lr scheduler's ``--total-num-update`` (0 where it has none)."""
        return getattr(self._args, "total_num_update", 0)


def planned_options(args: argparse.Namespace, given: RunConfig, planned: RunConfig) -> argparse.Namespace:
    """``args`` with the values the plan chose in place of ``auto`` (the micro-batch flags, ``--ddp-backend``
    and its ``--shard-fractions``), for the components and the checkpoint's options."""
    chosen: dict[str, Any] = {dest: getattr(planned.data, dest) for dest in ("max_sentences", "max_tokens")
                              if getattr(planned.data, dest) != getattr(given.data, dest)}
    if planned.parallel.ddp_backend != given.parallel.ddp_backend:
        chosen["ddp_backend"] = planned.parallel.ddp_backend
    fractions = planned.parallel.shard_fractions
    if fractions != given.parallel.shard_fractions and fractions is not None:
        chosen["shard_fractions"] = ",".join(map(repr, fractions))
    return argparse.Namespace(**{**vars(args), **chosen})


def build_trainer(args: argparse.Namespace, model: torch.nn.Module, criterion: torch.nn.Module,
                  context: DistributedContext, dummy: dict[str, Any], loss_scaler: Optional[LossScaler] = None,
                  parallel: Optional[ParallelConfig] = None) -> Trainer:
    """The trainer of ``args``: its ``--ddp-backend`` strategy, ``--optimizer`` (built by the strategy),
    ``--lr-scheduler`` and ``--precision``, with the job's ``loss_scaler`` (see
    :func:`hetfair.precision.mixed.job_loss_scaler`). The ranks must have agreed on their settings already
    (:mod:`hetfair.run.startup`): the strategies' collectives differ. ``parallel``: the job's parallelism as the
    start-up exchange completed it (:mod:`hetfair.memory.plan`; default: the flags' own)."""
    recipe = OPTIMIZER_REGISTRY.get(args.optimizer)
    strategy = build_strategy(parallel or ParallelConfig.from_args(args), context)
    return Trainer(
        TrainerConfig.from_args(args), model, criterion, context, dummy,
        optimizer_factory=lambda params: strategy.build_optimizer(recipe, args, params),
        lr_scheduler_factory=lambda optimizer: LR_SCHEDULER_REGISTRY.get(args.lr_scheduler)(args, optimizer),
        loss_scaler=loss_scaler, strategy=strategy,
    )

"""The training loop of one process: epochs, updates, validation, checkpoints, logging."""

from __future__ import annotations

import argparse
import math
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from hetfair.balance import LoadBalancer
from hetfair.checkpoint.layout import CheckpointConfig, Checkpointer, Stateful
from hetfair.criteria.fit import check_criterion_fits
from hetfair.data.epoch_updates import EpochSchedule, EpochUpdates, Update
from hetfair.data.batch_plan import split_counts
from hetfair.data.rank_batches import dummy_batch
from hetfair.data.update_shape import UpdateShape
from hetfair.models.deferred_init import build_deferred
from hetfair.parallel import STRATEGY_REGISTRY, ParallelConfig
from hetfair.parallel.comm_advice import CommAdvisor, LinkMeasurement
from hetfair.parallel.comm_hooks import CommStatePart
from hetfair.parallel.context import DistributedContext
from hetfair.parallel.nodes import gather_layout
from hetfair.launch.preemption import StopAgreement, requested_by
from hetfair.parallel.stats import UpdateResult
from hetfair.errors import ConfigError, Preempted
from hetfair.logging.meters import IntervalStats, Stopwatch
from hetfair.logging.progress import Progress, format_metric
from hetfair.logging.tensorboard import TensorBoardLogger
from hetfair.memory.budget import device_budget
from hetfair.memory.plan import StateSize, check_fit, complete_parallel_config
from hetfair.memory.table import FirstUpdateMemory, gather_rows, over_budget_lines, table_lines
from hetfair.models import HetfairModel
from hetfair.optim import OPTIMIZER_REGISTRY
from hetfair.optim.lr_scheduler.schedule_length import schedule_length_warning
from hetfair.options import plain_config
from hetfair.plan.planner import JobPlan, PlanPart, Planner, plan_probes
from hetfair.precision.auto import resolved_precision
from hetfair.plan.probe import longest_sample_batches
from hetfair.plan.state import optimizer_state_ratio, parameter_bytes
from hetfair.precision.mixed import job_loss_scaler
from hetfair.rng import RngState, seed_everything
from hetfair.run.config import DataConfig, LoopConfig, RunConfig
from hetfair.run.state import BalancerPart, BatchPart, Position, TrainingClock
from hetfair.run.startup import LOSS_SCALE, PARALLELISM, JobFacts, RankFacts, agree_at_start_up
from hetfair.tasks import TASK_REGISTRY, Task
from hetfair.trainer import Trainer
from hetfair.utils import check_output_dir, move_to_device
from hetfair.run.validation import Validator


def local_capacity(data: DataConfig, task: Task, max_sentences: Optional[int]) -> int:
    """Samples this process takes per micro-batch, from ``--max-sentences`` and/or ``--max-tokens``."""
    capacity = max_sentences if max_sentences is not None else math.inf
    if data.max_tokens is not None:
        positions = task.max_positions()
        if positions is None:
            raise ConfigError(f"task '{data.task}' has no fixed sample length; use --max-sentences instead of --max-tokens")
        if data.max_tokens < positions:
            raise ConfigError(f"--max-tokens {data.max_tokens} is smaller than one sample ({positions} tokens)")
        capacity = min(capacity, data.max_tokens // positions)
    return int(capacity)


def command_shape(data: DataConfig, caps: list[int]) -> UpdateShape:
    """The updates of a fresh run: ``--global-batch-size`` samples per step (default: the sum of the
    per-rank batch sizes), ``--update-freq`` steps each (default 1)."""
    return UpdateShape.of(data.global_batch_size or sum(caps), data.update_freq or 1)


def resumed_shape(data: DataConfig, saved: UpdateShape) -> UpdateShape:
    """The updates of a run resumed from a checkpoint of ``saved`` updates.

    Only flags on the command line count, never defaults: without ``--update-freq`` the update
    keeps the checkpoint's samples (``--global-batch-size`` alone must divide them); with it, the
    update is ``--global-batch-size`` (default: the checkpoint's) times ``--update-freq``.
    """
    step, freq = data.global_batch_size, data.update_freq
    if freq is not None:
        return UpdateShape.of(step or saved.step_size, freq)
    if step is None:
        return saved
    if saved.update_size % step:
        raise ConfigError(f"--global-batch-size {step} does not divide the checkpoint's {saved.update_size} samples "
                          f"per update ({saved.step_size} x --update-freq {saved.steps_per_update}); give a global "
                          f"batch that divides it, or add --update-freq N to train updates of {step} x N samples")
    return UpdateShape.of(step, saved.update_size // step)


def fit_shape(data: DataConfig, nominal: UpdateShape, caps: list[int], steps_free: bool = False) -> UpdateShape:
    """``nominal`` cut into steps the ranks can hold: more steps per update when one step does not fit,
    unless ``--fixed-update-freq`` forbids it. ``steps_free``: nothing chose the steps (a resumed run
    without batch flags or balancing), so each update takes as few as the ranks hold, fewer than
    ``nominal``'s too."""
    planned = UpdateShape(nominal.update_size, nominal.update_size) if steps_free else nominal
    shape = planned.fitted(sum(caps))
    if shape != nominal and data.fixed_update_freq:
        raise ConfigError(
            f"the global batch of {nominal.step_size} samples does not fit in one step of {len(caps)} process(es) "
            f"with batch sizes {caps} ({sum(caps)} together) and --fixed-update-freq forbids more steps per update; "
            f"drop --fixed-update-freq, raise --max-sentences or add processes")
    if data.auto_balance and shape.step_size < len(caps):
        raise ConfigError(f"--auto-balance needs a --global-batch-size of at least one sample per process "
                          f"({len(caps)})")
    return shape


def check_before_start(args: argparse.Namespace) -> None:
    """What this run needs beyond valid option values; checked before any process is started.

    A run must end (``--max-epoch`` or ``--max-update``: 0 means no limit on that count, and
    both unlimited is refused rather than training forever), its checkpoint and TensorBoard
    directories must be writable and a named ``--restore-file`` must exist.
    """
    loop = LoopConfig.from_args(args)
    if not loop.max_epoch and not loop.max_update:
        raise ConfigError("training would never end: give --max-epoch N or --max-update N "
                          "(0 means no limit on that count; one of them needs a limit)")
    CheckpointConfig.from_args(args).check_paths()
    if loop.tensorboard_logdir:
        check_output_dir("--tensorboard-logdir", loop.tensorboard_logdir)


def train(args: argparse.Namespace, context: DistributedContext) -> None:
    """Train until ``--max-epoch`` / ``--max-update``; resumes from ``--restore-file`` if present.

    On the master, what components log (``logging`` at INFO, e.g. which data a task
    found) is printed with the progress output.
    """
    progress = Progress(args.log_format, enabled=context.is_master)
    with progress.showing_log_records():
        run = TrainingRun(args, context, progress)
        if not args.dry_run:
            run.run()


class Regroup(Exception):
    """Live recovery: every rank left the loop at the same update boundary to let the membership change."""


class TrainingRun:
    """One process's training run: set-up, the epoch/update loop, validation and checkpoints as scheduled.

    The loop reads its :class:`RunConfig` sections; ``args`` go to the components (task, model,
    criterion, optimizer, schedule) and, as plain data, into checkpoints. Live recovery
    (:mod:`hetfair.live`) builds one per membership: ``resume_state`` (:meth:`Checkpointer.state` of a
    run before) replaces the checkpoint file, and when ``regroup_wanted`` turns true on any rank every
    rank raises :class:`Regroup` after the same update.
    """

    def __init__(self, args: argparse.Namespace, context: DistributedContext,
                 progress: Optional[Progress] = None, resume_state: Optional[dict[str, Any]] = None,
                 regroup_wanted: Optional[Callable[[], bool]] = None) -> None:
        args = argparse.Namespace(**{**vars(args), "precision": resolved_precision(args.precision, context.device)})
        self.resume_state = resume_state
        self._regroup_wanted = regroup_wanted
        self.context = context
        self.progress = progress or Progress(args.log_format, enabled=context.is_master)
        seed_everything(args.seed)
        self.task = TASK_REGISTRY.get(args.task).setup_task(args)
        self.train_data = self.task.dataset(args.train_subset)
        model = self._build_model(args)
        criterion = self.task.build_criterion(args)
        dummy = dummy_batch(self.train_data, self.task.collater)
        deferred = any(param.is_meta for param in model.parameters())  # no values until the strategy shards it
        if not deferred:
            self._check_criterion(model, criterion, dummy, args)
        self.plan, self.args = self._make_plan(args, model, criterion)  # every "auto" replaced by the plan's choice
        self.config = config = RunConfig.from_args(self.args, context.world_size, balance_lag=Trainer.TIMINGS_LAG)
        job = self._agree()
        self.precisions = job.precisions
        self.budget = job.budgets[context.rank]
        self.caps = self._capped_at_dataset(job.train_caps)
        self.nominal_shape = command_shape(config.data, self.caps)
        self.shape = fit_shape(config.data, self.nominal_shape, self.caps)
        self.balancer = self._new_balancer()
        self._show_plan()
        if not self.args.dry_run:  # a dry run ends with the plan: nothing trains, nothing is written
            self._set_up_training(model, criterion, dummy, job)
        self._check_schedule_length()  # once nothing else can fail at start-up: an error comes alone

    def _set_up_training(self, model: torch.nn.Module, criterion: torch.nn.Module, dummy: dict, job: JobFacts) -> None:
        """The trainer, validator, meters and checkpoints of the planned run; resume; announce it."""
        args, config, context = self.args, self.config, self.context
        deferred = any(param.is_meta for param in model.parameters())
        param_bytes = parameter_bytes(p for p in model.parameters() if p.requires_grad)  # whole: not sharded yet
        whole_parameters = sum(p.numel() for p in model.parameters())
        parallel = complete_parallel_config(config.parallel, job.budgets, job.budgets_measured, self._notice)
        self.trainer = Trainer.from_args(args, model, criterion, context, dummy,
                                         job_loss_scaler(job.precisions, config.precision.loss_scale), parallel)
        if deferred:  # every rank runs the trial forward alike (the sharded model's collectives)
            self._check_criterion(self.trainer.model, self.trainer.criterion, move_to_device(dummy, context.device), args)
        self._check_memory_fit(param_bytes, job.budgets)
        self._memory_to_report: Optional[FirstUpdateMemory] = None  # the first update's, once it runs
        # not where units are gathered: one rank recomputing a gathered unit the others do not recompute
        # mismatches their collectives (gloo aborts; sim_mlp with --sim-layers 1 and --activation-checkpointing 1,0)
        self._can_checkpoint = not self.trainer.config.activation_checkpointing and isinstance(
            model, HetfairModel) and bool(model.sharding_units()) and \
            self.trainer.strategy.largest_gathered_unit_bytes() == 0
        self._memory_table_wanted = context.world_size > 1 or any(budget is not None for budget in job.budgets)
        """The ``memory |`` table has something to say: several ranks, or a budget to hold a rank to (the same on
        every rank: it is a collective)."""
        self.comm = self.trainer.strategy.gradient_comm()
        self.comm_part = CommStatePart(self.comm, self._notice) if self.comm and self.comm.powersgd else None
        self.validator = Validator(self.task, self.trainer.model, self.trainer.criterion, context, job.valid_caps,
                                   config.data.num_workers,
                                   forward_every_batch=self.trainer.strategy.joins_every_micro_batch)
        self.position = Position()
        self.clock = TrainingClock()
        self.tensorboard = TensorBoardLogger(config.loop.tensorboard_logdir, enabled=context.is_master)
        reduce_metrics = self.trainer.criterion.reduce_metrics
        self.interval = IntervalStats(reduce_metrics)
        self.epoch_stats = IntervalStats(reduce_metrics)
        self.stopwatch = Stopwatch()  # each update's seconds, for ups/wps
        self.checkpointer = Checkpointer(config.checkpoint, self._checkpoint_parts(),
                                         plain_config(args), context.is_master)
        self._shards_to_report = True  # after the first update, if the strategy has any
        self.preemption = StopAgreement(context, self._regroup_wanted)
        self.preempted = False  # every rank agreed to save and stop after the current update
        self._check_best_metric_exists()
        self.restored_from = self._restore()
        self.comm_advisor = self._measure_link()
        self._announce(whole_parameters)

    def _build_model(self, args: argparse.Namespace) -> torch.nn.Module:
        """The task's model; on the meta device where the strategy materialises only its rank's shards
        (not where the plan probes micro-batches or the backend on the whole model)."""
        if not plan_probes(args, self.context.world_size):
            parallel = ParallelConfig.from_args(args)
            if STRATEGY_REGISTRY.get(parallel.ddp_backend).builds_deferred(parallel):
                return build_deferred(lambda: self.task.build_model(args))
        return self.task.build_model(args)

    def _check_criterion(self, model: torch.nn.Module, criterion: torch.nn.Module, dummy: dict[str, Any],
                         args: argparse.Namespace) -> None:
        """A mismatch of criterion and task is one error line (a trial forward on one sample)."""
        names = {"criterion": args.criterion, "task": args.task, "arch": args.arch}
        check_criterion_fits(model, criterion, dummy, names)

    def _make_plan(self, args: argparse.Namespace, model: torch.nn.Module,
                   criterion: torch.nn.Module) -> tuple[JobPlan, argparse.Namespace]:
        """The job's plan (probing this rank's micro-batch where it is ``auto``), and the options it resolves."""
        units = model.sharding_units() if isinstance(model, HetfairModel) else []
        recipe = OPTIMIZER_REGISTRY.get(args.optimizer)
        planner = Planner(args, self.context, model, criterion, longest_sample_batches(self.train_data,
                                                                                       self.task.collater),
                          len(self.train_data), self.task.max_positions(), units,
                          lambda params: recipe.build(args, params))
        return planner.plan()

    def _show_plan(self) -> None:
        """The ``plan |`` table, where anything was ``auto`` or for ``--dry-run``."""
        if not (self.plan.automatic or self.args.dry_run):
            return
        step = self.shape.step_size
        split = self.balancer.split if self.balancer is not None else split_counts(step, self.caps, self.caps)
        for line in self.plan.lines(self.caps, [count / step for count in split]):
            self._notice(line)
        if self.args.dry_run:
            self._notice("dry run | the plan above; nothing was trained or written (drop --dry-run to train)")

    def _check_schedule_length(self) -> None:
        """Warn where ``--total-num-update`` is not about the updates this run will make."""
        loop = self.config.loop
        warning = schedule_length_warning(getattr(self.args, "total_num_update", 0), loop.max_update,
                                          loop.max_epoch, len(self.train_data), self.nominal_shape.update_size)
        if warning is not None and self.context.is_master:
            print(f"hetfair-train: warning: {warning}", file=sys.stderr, flush=True)

    def _agree(self) -> JobFacts:
        """The one start-up exchange: every rank's precision and batch sizes; the shared settings checked."""
        config, data = self.config, self.config.data
        given = self.args.memory_budget
        budget = given if given is not None else device_budget(self.context.device)
        own = RankFacts(config.precision.precision, local_capacity(data, self.task, data.max_sentences),
                        local_capacity(data, self.task, data.max_sentences_valid or data.max_sentences),
                        {PARALLELISM: config.parallel.shared_settings(),
                         LOSS_SCALE: config.precision.loss_scale.shared_settings()},
                        budget, given is None and budget is not None)
        return agree_at_start_up(self.context, own)

    def _check_memory_fit(self, param_bytes: int, budgets: list[Optional[int]]) -> None:
        """Refuse a plan where some rank's share of the state does not fit its budget (the same on every rank)."""
        strategy = self.trainer.strategy
        recipe = OPTIMIZER_REGISTRY.get(self.args.optimizer)
        ratio = optimizer_state_ratio(lambda params: recipe.torch_class(params, **recipe.torch_kwargs(self.args)))
        shares = [strategy.state_shares(rank) for rank in range(self.context.world_size)]
        size = StateSize(param_bytes, ratio, strategy.largest_gathered_unit_bytes())
        check_fit(size, shares, budgets, strategy.takes_shard_fractions, self.context.device.type == "cuda")

    def _capped_at_dataset(self, caps: list[int]) -> list[int]:
        """Per-rank batch sizes, none above the training set's size: a larger micro-batch holds no more samples."""
        samples = len(self.train_data)
        capped = [min(cap, samples) for cap in caps]
        if capped != caps:
            self._notice(f"batch | a micro-batch holds at most the {samples} training samples: per-rank batch sizes "
                         f"{caps} are cut to {capped}")
        return capped

    def _checkpoint_parts(self) -> dict[str, Stateful]:
        parts: dict[str, Stateful] = {"trainer": self.trainer, "position": self.position, "clock": self.clock,
                                      "epoch_stats": self.epoch_stats}
        parts["batch"] = BatchPart(lambda: self.nominal_shape, self._restore_shape)
        if self.balancer is not None:
            parts["balance"] = BalancerPart(lambda: self.balancer, self._notice)
        parts["plan"] = PlanPart(lambda: self.plan.summary(self.caps), self._notice)
        if self.trainer.loss_scaler is not None:
            parts["loss_scale"] = self.trainer.loss_scaler
        if self.comm_part is not None:
            parts["comm"] = self.comm_part
        parts["rng"] = RngState()  # last: restoring the other parts must not disturb the generators
        return parts

    def _new_balancer(self) -> Optional[LoadBalancer]:
        if not self.config.data.auto_balance:
            return None
        return LoadBalancer(self.caps, self.shape.step_size, self.config.balance)

    def _restore_shape(self, saved: UpdateShape) -> None:
        """Keep the checkpoint's updates (its samples per update) on this run's ranks, unless the
        command line asks for others; balancing then starts afresh on the new steps."""
        data = self.config.data
        nominal = resumed_shape(data, saved)
        if nominal.update_size != saved.update_size:
            self._notice(f"restore | the command line's global batch {nominal.step_size} x --update-freq "
                         f"{nominal.steps_per_update} replaces the checkpoint's {saved.step_size} x "
                         f"{saved.steps_per_update}: the updates differ from those of the run that wrote it")
        self.nominal_shape = nominal
        typed = data.global_batch_size is not None or data.update_freq is not None
        steps_free = not (typed or data.fixed_update_freq or data.auto_balance)  # balancing needs the step's room
        self.shape = fit_shape(data, nominal, self.caps, steps_free)
        self.balancer = self._new_balancer()

    # -- the loop ----------------------------------------------------------------
    def run(self) -> None:
        """Train to the end, or until preempted (then raise :class:`Preempted`); every save is on disk after it."""
        if self.should_stop():
            self._notice(self._nothing_to_do())
            return
        try:
            while not self.should_stop():
                self.train_epoch()
            self.preemption.close()
        finally:
            self.progress.end_epoch()
            self.tensorboard.close()
            self.checkpointer.close()  # the last save is complete (or its error raised) before the process ends
        if self.preempted:
            raise Preempted(self._preemption_detail(), self._preemption_cause())
        self._summarize()

    def should_stop(self) -> bool:
        """The stopping rule: preempted, ``--max-update`` updates done, or every epoch up to ``--max-epoch`` done."""
        loop = self.config.loop
        if self.preempted:
            return True
        if loop.max_update and self.trainer.num_updates >= loop.max_update:
            return True
        return bool(loop.max_epoch) and self.position.epoch > loop.max_epoch

    def _stop_reason(self) -> str:
        """The limit :meth:`should_stop` hit, as the flag that set it: ``--max-update 500``."""
        loop = self.config.loop
        if loop.max_update and self.trainer.num_updates >= loop.max_update:
            return f"--max-update {loop.max_update}"
        return f"--max-epoch {loop.max_epoch}"

    def _nothing_to_do(self) -> str:
        reason = self._stop_reason()
        source = f" ({self.restored_from} has {self.trainer.num_updates} updates)" if self.restored_from else ""
        return f"nothing to do: {reason} reached{source}; raise {reason.split()[0]} to train further"

    def train_epoch(self) -> None:
        """Train the rest of the current epoch; unless training stops inside it, end it."""
        self.task.begin_epoch(self.position.epoch)
        updates = self._epoch_updates()
        self.progress.start_epoch(self.position.epoch, updates.steps_left(), 0)
        self.interval.reset()  # a train_inner line never spans two epochs
        self.stopwatch.restart()
        for update in updates:
            updates_before = self.trainer.num_updates
            self.train_update(update)
            self.checkpointer.check()  # a background save that failed stops training here
            self.preempted = self.preemption.poll()
            end_of_epoch = self.position.samples_done >= len(self.train_data)
            skipped = self.trainer.num_updates == updates_before
            if skipped and not self.preempted:  # skipped (fp16 overflow): nothing new is due
                self._regroup_if_wanted()
                if end_of_epoch:
                    break
                continue
            stopping = self.should_stop()
            self.after_update(stopping, end_of_epoch)
            if not stopping:
                self._regroup_if_wanted()
            if end_of_epoch:
                break  # end_epoch() logs the epoch, validates and saves
            if stopping:
                return
        self.progress.end_epoch()
        self.end_epoch()

    def _regroup_if_wanted(self) -> None:
        if self.preemption.regroup:
            raise Regroup()

    def _epoch_updates(self) -> EpochUpdates:
        schedule = EpochSchedule(self.caps, self.shape, self.config.loop.seed)
        return EpochUpdates(self.train_data, self.task.collater, schedule, self.context.rank, self.position.epoch,
                            start=self.position.samples_done, split=self._current_split,
                            num_workers=self.config.data.num_workers, pin_memory=self.context.device.type == "cuda")

    def _current_split(self) -> Optional[list[int]]:
        """The per-rank shares of each global batch: the balancer's, else proportional to the batch sizes."""
        return list(self.balancer.split) if self.balancer is not None else None

    def train_update(self, update: Update) -> None:
        """One update (or one skipped for an fp16 overflow: the data moves on either way); its
        statistics go to the meters and the balancer (which may move the split)."""
        if self._shards_to_report and self._memory_table_wanted and self._memory_to_report is None:
            self._memory_to_report = FirstUpdateMemory(self.context.device, self.trainer.optimizer)
        result = self.trainer.train_step(update.micro_batches)
        seconds = self.stopwatch.lap()
        self.position.samples_done += update.global_samples
        if result is not None:
            if self._shards_to_report and not result.skipped:
                if self._memory_table_wanted:
                    self._report_memory(result.samples[self.context.rank])
                self._report_optimizer_shards()
            self.interval.add(result, seconds)
            self.epoch_stats.add(result, seconds)
            self._rebalance(result)
            self._advise_comm(result)
        # the bar's loss: of the updates since the last train_inner line, from the stats already synced
        self.progress.step(len(update.micro_batches), self.interval.criterion_metrics)

    def _rebalance(self, result: UpdateResult) -> None:
        """Show the balancer this update's per-rank timings and log a new split."""
        if self.balancer is None:
            return
        split = self.balancer.observe(result.timed_samples, result.compute_seconds)
        if split is not None:
            self._log("balance", {f"split{rank}": count for rank, count in enumerate(split)})

    def _measure_link(self) -> Optional[CommAdvisor]:
        """Time one all-reduce of the gradients' size (a collective), for the ``comm |`` line; where the
        strategy's gradients travel in one (a replicated run of several processes)."""
        if self.comm is None:
            return None
        link = LinkMeasurement(self.comm.gradient_bytes, self.comm.time_all_reduce(),
                               self.comm.powersgd_bytes(self.config.parallel.powersgd_rank),
                               len(gather_layout(self.context)))
        kept = self.comm.mode if self.comm.requested == "auto" and self.comm.mode != "none" else None
        return CommAdvisor(link, self.comm.requested, kept)

    def _advise_comm(self, result: UpdateResult) -> None:
        """Once the compute time is known: log the ``comm |`` line; with ``auto``, switch to its choice."""
        advice = self.comm_advisor.observe(result.compute_seconds) if self.comm_advisor else None
        if advice is not None and self.comm is not None:
            self.comm.select(advice.chosen)
            self._notice(advice.line())

    def _report_memory(self, samples: float) -> None:
        """The ``memory |`` table of the first update, and a warning for each rank past its budget (a collective)."""
        assert self._memory_to_report is not None
        own = self._memory_to_report.finish(self.trainer.strategy, self.trainer.optimizer, self.budget, samples,
                                            self._can_checkpoint)
        rows = gather_rows(self.context, own)
        warnings = over_budget_lines(rows, self.context.device.type, self.trainer.strategy.takes_shard_fractions)
        for line in table_lines(rows) + warnings:
            self._notice(line)

    def _report_optimizer_shards(self) -> None:
        """Log each rank's shard and optimizer-state bytes once, after the first update (a collective where
        the strategy shards them)."""
        self._shards_to_report = False
        report = self.trainer.strategy.shard_report(self.trainer.optimizer)
        if report:
            self.progress.log("zero", report, self.position.epoch, self.trainer.num_updates)

    # -- what is due between updates and after epochs ----------------------------------
    def after_update(self, stopping: bool, end_of_epoch: bool = False) -> None:
        """Log every ``--log-interval`` updates and at the end of an epoch or run; inside an epoch,
        validate and save as the ``--*-interval-updates`` say (all of them when ``stopping``, but
        a preempted run only saves)."""
        loop, num_updates = self.config.loop, self.trainer.num_updates
        if num_updates % loop.log_interval == 0 or end_of_epoch or stopping:
            self._log("train_inner", self.interval.metrics())
            self.interval.reset()
        if end_of_epoch:
            return  # end_epoch() validates and saves
        validating = (stopping and not self.preempted) or _every(loop.validate_interval_updates, num_updates)
        saving = stopping or _every(self.config.checkpoint.save_interval_updates, num_updates)
        if validating or saving:
            self.trainer.synchronize()  # every rank validates and saves the same model (an outer loop's round ends)
        valid_metric = self.validate() if validating else None
        if saving:
            self.checkpointer.save(self.position.epoch, num_updates, end_of_epoch=False, valid_metric=valid_metric)
        if stopping:
            self._log("train", self.epoch_stats.metrics())
        self.stopwatch.restart()  # validating and saving are not the next update's time

    def end_epoch(self) -> None:
        """Log the epoch, validate when due, step the epoch schedule, move to the next epoch and save."""
        finished_epoch = self.position.epoch
        self.trainer.synchronize()
        self._log("train", self.epoch_stats.metrics())
        self.epoch_stats.reset()
        valid_metric = None
        if finished_epoch % self.config.loop.validate_interval == 0 or self._is_last_epoch(finished_epoch):
            valid_metric = self.validate()
        self.trainer.lr_scheduler.step_epoch(finished_epoch, valid_metric)
        self.position.epoch, self.position.samples_done = finished_epoch + 1, 0
        self.checkpointer.save(finished_epoch, self.trainer.num_updates, end_of_epoch=True, valid_metric=valid_metric)

    def _is_last_epoch(self, epoch: int) -> bool:
        loop = self.config.loop
        return (bool(loop.max_epoch) and epoch >= loop.max_epoch) or (
            bool(loop.max_update) and self.trainer.num_updates >= loop.max_update
        )

    # -- validation -----------------------------------------------------------------
    def validate(self) -> Optional[float]:
        """Validate on every ``--valid-subset``; return the first one's best-checkpoint metric."""
        if self.config.loop.disable_validation:
            return None
        first_metric = None
        for subset in self.config.loop.valid_subsets:
            metrics = self.validator.metrics(subset)
            self._log(subset, metrics)
            if first_metric is None:
                first_metric = self._best_metric(metrics)
        return first_metric

    def _check_best_metric_exists(self) -> None:
        """Fail at start-up, not after an epoch, when the best-checkpoint metric is not reported."""
        if self.config.loop.disable_validation or self.config.checkpoint.no_save:
            return
        keys = self.validator.log_keys(self.config.loop.valid_subsets[0])
        self._best_metric(self.trainer.criterion.reduce_metrics(dict.fromkeys(keys, 0.0)))

    def _best_metric(self, metrics: dict[str, float]) -> float:
        name = self.config.loop.best_checkpoint_metric
        if name not in metrics:
            raise ConfigError(
                f"--best-checkpoint-metric {name} is not reported by the criterion; choose one of: "
                f"{', '.join(sorted(metrics))}"
            )
        return metrics[name]

    # -- checkpoints --------------------------------------------------------------------
    def _restore(self) -> Optional[Path]:
        """Resume from the checkpoint, if any; say so, and which optimizer settings the command line changed.
        With a ``resume_state`` (live recovery) from that, silently: the live driver says where it came from."""
        if self.resume_state is not None:
            self.checkpointer.load(self.resume_state)
            return None
        path = self.checkpointer.restore()
        if path is None:
            self._say_what_no_save_leaves_alone()
            return None
        if self.comm_part is not None and not self.comm_part.loaded:
            self.comm_part.load_state_dict({})  # a checkpoint without PowerSGD state: says it starts afresh
        self.progress.log("restore", {"samples_done": self.position.samples_done}, self.position.epoch,
                          self.trainer.num_updates)
        changed = self.trainer.optimizer_overrides
        if changed:
            self._notice("restore | optimizer settings from the command line replace the checkpoint's: " + ", ".join(
                f"{name} {new} (was {old})" for name, (old, new) in changed.items()))
        return path

    def _say_what_no_save_leaves_alone(self) -> None:
        config = self.checkpointer.config
        last = config.restore_path()
        if not config.resumes() and last.is_file():
            self._notice(f"restore | not resuming from {last}: a --no-save run starts afresh "
                         f"(--restore-file {last} resumes from it)")

    def _preemption_detail(self) -> str:
        saved = ("no checkpoint written (--no-save)" if self.checkpointer.config.no_save else
                 f"saved {self.checkpointer.config.save_dir / 'checkpoint_last.pt'}; run the same command to resume")
        return f"stopped after update {self.trainer.num_updates} (epoch {self.position.epoch}); {saved}"

    @staticmethod
    def _preemption_cause() -> str:
        signum = requested_by()
        return signal.Signals(signum).name if signum is not None else "a signal to another rank"

    # -- logging -----------------------------------------------------------------------
    def _notice(self, line: str) -> None:
        if self.context.is_master:
            self.progress.info(line)

    def _log(self, phase: str, metrics: dict[str, float]) -> None:
        if not metrics:
            return
        if phase.startswith("train"):
            metrics = {**metrics, "wall": self.clock.seconds()}
        self.progress.log(phase, metrics, self.position.epoch, self.trainer.num_updates)
        self.tensorboard.log(phase, metrics, self.trainer.num_updates)

    def _summarize(self) -> None:
        """The end-of-run line: updates, epochs, wall time, best metric and where the checkpoints are."""
        position, checkpoints = self.position, self.checkpointer
        epochs = str(position.epoch - 1) if position.samples_done == 0 else \
            f"{position.epoch - 1 + position.samples_done / len(self.train_data):.2f}"
        fields = [f"num_updates {self.trainer.num_updates}", f"epochs {epochs}",
                  f"wall {timedelta(seconds=round(self.clock.seconds()))}"]
        if checkpoints.best_metric is not None:
            name = self.config.loop.best_checkpoint_metric
            fields.append(f"best {name} {format_metric(name, checkpoints.best_metric)} "
                          f"({checkpoints.config.save_dir / 'checkpoint_best.pt'})")
        if not checkpoints.config.no_save:
            fields.append(f"last {checkpoints.config.save_dir / 'checkpoint_last.pt'}")
        self._notice("done | " + " | ".join(fields))
        if self.tensorboard.logdir is not None:
            self._notice(f"TensorBoard logs are in {self.tensorboard.logdir}; "
                         f"view them with: tensorboard --logdir {self.tensorboard.logdir}")

    def _announce(self, whole_parameters: int) -> None:
        """The ``setup |`` lines: ``parameters`` counts the whole model, ``rank0_parameters`` (where the state is
        sharded) the elements rank 0 holds of it."""
        if not self.context.is_master:
            return
        strategy = self.trainer.strategy
        held = sum(t.numel() for t in strategy.local_tensors(list(self.trainer.model.parameters())))
        counts = {"parameters": whole_parameters, **({"rank0_parameters": held} if held != whole_parameters else {})}
        self.progress.log("setup", {**counts, "world_size": self.context.world_size,
                                    "global_batch": self.nominal_shape.step_size,
                                    "train_samples": len(self.train_data)},
                          self.position.epoch, self.trainer.num_updates)
        caps = ", ".join(f"rank {r}: {c}" for r, c in enumerate(self.caps))
        precisions = ", ".join(f"rank {r}: {p}" for r, p in enumerate(self.precisions))
        scaler = self.trainer.loss_scaler
        scaling = f" | loss scale {scaler.scale:g}" if scaler is not None else ""
        # e.g. BERT's --init-from-hf directory or --config_file decides the size, not --arch
        init_from, config_file = getattr(self.args, "init_from_hf", None), getattr(self.args, "config_file", None)
        shape = f"init-from-hf {init_from}" if init_from else f"config {config_file}" if config_file else \
            f"arch {self.args.arch}"
        self.progress.info(f"setup | model {self.args.model} ({shape}) | task {self.args.task} | "
                           f"per-rank batch {caps} | per-rank precision {precisions}{scaling} | "
                           f"device {self.context.device}")
        nominal = self.nominal_shape
        if self.shape.steps_per_update < nominal.steps_per_update:
            self.progress.info(f"batch | these processes hold {sum(self.caps)} samples together: each update of "
                               f"{nominal.update_size} samples takes {self.shape.steps_per_update} step(s) of up to "
                               f"{self.shape.step_size} (--update-freq {nominal.steps_per_update} lowered to "
                               f"{self.shape.steps_per_update})")
        elif self.shape != nominal:
            self.progress.info(f"batch | the global batch of {nominal.step_size} does not fit in one step of these "
                               f"processes ({sum(self.caps)} samples together): each update of {nominal.update_size} "
                               f"samples takes {self.shape.steps_per_update} steps of up to {self.shape.step_size} "
                               f"(--update-freq {nominal.steps_per_update} raised to {self.shape.steps_per_update})")


def _every(interval: int, num_updates: int) -> bool:
    """True every ``interval`` updates (never for 0: off)."""
    return interval > 0 and num_updates % interval == 0

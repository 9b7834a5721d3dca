"""One process's training run: :class:`TrainingRun` sets it up from the options (through
:mod:`hetfair.run.wiring`, the edge that reads them) and runs the loop (:mod:`hetfair.run.loop`), which
reports through :mod:`hetfair.run.reporting`; plus the checks before any process starts and the shapes
of the updates (per-rank capacities, ``--global-batch-size`` x ``--update-freq``, resumed and fitted)."""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional

from hetfair.balance import PROBE_PART, BalanceConfig, LoadBalancer, probe_samples
from hetfair.checkpoint.layout import CheckpointConfig, Checkpointer, Stateful
from hetfair.data.update_shape import UpdateShape
from hetfair.errors import ConfigError
from hetfair.launch.preemption import StopAgreement
from hetfair.logging.meters import IntervalStats, Stopwatch
from hetfair.logging.progress import Progress
from hetfair.logging.tensorboard import TensorBoardLogger
from hetfair.memory.budget import device_budget
from hetfair.memory.plan import StateSize, check_fit, complete_parallel_config
from hetfair.memory.table import FirstUpdateMemory
from hetfair.models import HetfairModel
from hetfair.optim.lr_scheduler.schedule_length import schedule_length_warning
from hetfair.parallel.gradient_comm import CommStatePart
from hetfair.parallel.context import DistributedContext
from hetfair.plan.planner import PlanPart
from hetfair.plan.state import parameter_bytes
from hetfair.precision.mixed import job_loss_scaler
from hetfair.rng import RngState
from hetfair.run.config import DataConfig, LoopConfig
from hetfair.run.loop import TrainingLoop
from hetfair.parallel import STRATEGY_REGISTRY
from hetfair.parallel.collectives import all_gather_json
from hetfair.run.startup import LOSS_SCALE, PARALLELISM, JobFacts, RankFacts, agree_at_start_up, group_caps
from hetfair.run.state import BalancerPart, BatchPart, Position, TrainingClock
from hetfair.run.validation import Validator
from hetfair.run.wiring import Components, RunWiring
from hetfair.tasks import Task
from hetfair.utils import check_output_dir, move_to_device


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
    if args.auto_balance and args.inner_steps_by == "time":
        raise ConfigError("--auto-balance and --inner-steps-by time both share the work by speed: drop one "
                          "(--inner-steps-by time gives a fast node more inner steps, --auto-balance more samples "
                          "per step)")
    if args.auto_balance:
        BalanceConfig.from_args(args)  # a --balance-start it does not know is one line before any process starts
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


class TrainingRun(TrainingLoop):
    """One process's training run: set-up, the epoch/update loop, validation and checkpoints as scheduled.

    Only the constructor sees ``args``, through :class:`~hetfair.run.wiring.RunWiring`: the components (task,
    model, criterion, optimizer, schedule) are built from them and, as plain data, they go into checkpoints;
    everything else reads the plan's :class:`~hetfair.run.config.RunConfig`. Live recovery
    (:mod:`hetfair.live`) builds one per membership: ``resume_state`` (:meth:`Checkpointer.state` of a
    run before) replaces the checkpoint file, and when ``regroup_wanted`` turns true on any rank every
    rank raises :class:`~hetfair.run.loop.Regroup` after the same update.
    """

    def __init__(self, args: argparse.Namespace, context: DistributedContext,
                 progress: Optional[Progress] = None, resume_state: Optional[dict[str, Any]] = None,
                 regroup_wanted: Optional[Callable[[], bool]] = None) -> None:
        wiring = RunWiring(args, context)
        self.resume_state = resume_state
        self._regroup_wanted = regroup_wanted
        self.context = context
        self.progress = progress or Progress(wiring.config.loop.log_format, enabled=context.is_master)
        components = wiring.build_components()
        self.task, self.train_data = components.task, components.train_data
        self.plan = wiring.plan(components)  # the configuration's every "auto" replaced by the plan's choice
        self.config = config = wiring.config
        self.model_description = wiring.model_description()
        job = self._agree()
        self.precisions = job.precisions
        self.budget = job.budgets[context.rank]
        groups = STRATEGY_REGISTRY.get(config.parallel.ddp_backend).data_groups(config.parallel, context.world_size)
        self.data_groups = groups
        self.data_rank = next(index for index, group in enumerate(groups) if context.rank in group)
        if len(groups) < context.world_size and config.data.auto_balance:
            raise ConfigError(f"--auto-balance moves samples between ranks that load their own, but with "
                              f"--ddp-backend {config.parallel.ddp_backend} ranks share their samples; drop "
                              f"--auto-balance")
        probed = [row.probed is not None for row in self.plan.ranks]
        self.caps = self._capped_at_dataset(group_caps(job.train_caps, groups, "--max-sentences", probed))
        self.valid_caps = group_caps(job.valid_caps, groups, "--max-sentences-valid")
        self.nominal_shape = command_shape(config.data, self.caps)
        self.shape = fit_shape(config.data, self.nominal_shape, self.caps)
        self._balance_speeds: Optional[list[float]] = None
        """Every rank's probed samples per second, where the balancer starts from them."""
        self.balancer = self._new_balancer()
        self._show_plan()
        if not config.loop.dry_run:  # a dry run ends with the plan: nothing trains, nothing is written
            self._set_up_training(wiring, components, job)
        self._check_schedule_length(wiring.scheduled_updates())  # once nothing else can fail: an error comes alone

    def _set_up_training(self, wiring: RunWiring, components: Components, job: JobFacts) -> None:
        """The trainer, validator, meters and checkpoints of the planned run; resume; announce it."""
        config, context, model = self.config, self.context, components.model
        deferred = components.deferred
        param_bytes = parameter_bytes(p for p in model.parameters() if p.requires_grad)  # whole: not sharded yet
        whole_parameters = sum(p.numel() for p in model.parameters())
        self.clock = TrainingClock()  # from here: the balancer's probe is training time
        self._start_balancer(wiring, components)
        parallel = complete_parallel_config(config.parallel, job.budgets, job.budgets_measured, self._notice)
        if STRATEGY_REGISTRY.get(parallel.ddp_backend).wants_rank_speeds(parallel):
            parallel = replace(parallel, rank_speeds=self._rank_speeds(wiring, components), rank_budgets=tuple(job.budgets),
                               optimizer_ratio=wiring.optimizer_state_ratio())
        self.trainer = wiring.build_trainer(components, job_loss_scaler(job.precisions, config.precision.loss_scale),
                                            parallel)
        if deferred:  # every rank runs the trial forward alike (the sharded model's collectives)
            wiring.check_criterion(self.trainer.model, self.trainer.criterion,
                                   move_to_device(components.dummy, context.device))
        self._check_memory_fit(param_bytes, wiring.optimizer_state_ratio(), job.budgets)
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
        self.comm_part = CommStatePart(self.comm, self._notice) if self.comm and self.comm.keeps_state else None
        self.validator = Validator(self.task, self.trainer.model, self.trainer.criterion, context, self.valid_caps,
                                   config.data.num_workers,
                                   forward_every_batch=self.trainer.strategy.joins_every_micro_batch,
                                   data_rank=self.data_rank, runner=self.trainer.strategy.micro_batch_runner())
        self.position = Position()
        self.tensorboard = TensorBoardLogger(config.loop.tensorboard_logdir, enabled=context.is_master)
        reduce_metrics = self.trainer.criterion.reduce_metrics
        self.interval = IntervalStats(reduce_metrics)
        self.epoch_stats = IntervalStats(reduce_metrics)
        self.stopwatch = Stopwatch()  # each update's seconds, for ups/wps
        self.checkpointer = Checkpointer(config.checkpoint, self._checkpoint_parts(), wiring.stored_options(),
                                         context.is_master)
        self._shards_to_report = True  # after the first update, if the strategy has any
        self.preemption = StopAgreement(context, self._regroup_wanted)
        self.preempted = False  # every rank agreed to save and stop after the current update
        self._check_best_metric_exists()
        self.restored_from = self._restore()
        self.comm_advisor = self._measure_link()
        for line in self.trainer.strategy.plan_lines(self.caps):
            self._notice(line)
        self._announce(whole_parameters)

    def _start_balancer(self, wiring: RunWiring, components: Components) -> None:
        """With ``--balance-start probe`` and several ranks, time one short step on every rank (:func:`probe_samples`,
        after one untimed; a collective) and start the balancer's split from the speeds. On the unwrapped model,
        before the strategy's hooks: a model that gets its values only when sharded is not probed. A checkpoint's
        split, restored after this, replaces the start."""
        if self.balancer is None or self.config.balance.start != "probe" or len(self.caps) == 1:
            return
        if components.deferred:
            self._notice("balance | the model has no values before it is sharded: no probe, the split starts "
                         "in proportion to the batch sizes")
            return
        started = time.perf_counter()
        speed = wiring.samples_per_second(components, probe_samples(self.balancer.split[self.data_rank]), steps=1)
        probes = all_gather_json(self.context, [speed, time.perf_counter() - started])
        self._balance_speeds = [float(rank_speed) for rank_speed, _seconds in probes]
        self.balancer = self._new_balancer()
        speeds = ", ".join(f"{rank_speed:.1f}" for rank_speed in self._balance_speeds)
        self._notice(f"balance | starting split {','.join(map(str, self.balancer.split))} by the probed speeds "
                     f"{speeds} samples/s (a step of 1/{PROBE_PART} of each rank's share at the batch sizes, after one "
                     f"untimed: {max(seconds for _speed, seconds in probes):.2f} s on the slowest rank)")

    def _rank_speeds(self, wiring: RunWiring, components: Components) -> tuple[float, ...]:
        """Every rank's samples per second through the whole model (:meth:`RunWiring.samples_per_second`); a
        collective."""
        return tuple(float(speed) for speed in all_gather_json(self.context, wiring.samples_per_second(components)))

    def _check_schedule_length(self, scheduled_updates: int) -> None:
        """Warn where ``--total-num-update`` (``scheduled_updates``) is not about the updates this run will make."""
        loop = self.config.loop
        warning = schedule_length_warning(scheduled_updates, loop.max_update,
                                          loop.max_epoch, len(self.train_data), self.nominal_shape.update_size)
        if warning is not None and self.context.is_master:
            print(f"hetfair-train: warning: {warning}", file=sys.stderr, flush=True)

    def _agree(self) -> JobFacts:
        """The one start-up exchange: every rank's precision and batch sizes; the shared settings checked."""
        config, data = self.config, self.config.data
        given = config.memory.budget
        budget = given if given is not None else device_budget(self.context.device)
        own = RankFacts(config.precision.precision, local_capacity(data, self.task, data.max_sentences),
                        local_capacity(data, self.task, data.max_sentences_valid or data.max_sentences),
                        {PARALLELISM: config.parallel.shared_settings(),
                         LOSS_SCALE: config.precision.loss_scale.shared_settings()},
                        budget, given is None and budget is not None)
        return agree_at_start_up(self.context, own)

    def _check_memory_fit(self, param_bytes: int, ratio: float, budgets: list[Optional[int]]) -> None:
        """Refuse a plan where some rank's share of the state (``ratio``: the optimizer's per parameter byte) does not
        fit its budget (the same on every rank)."""
        strategy = self.trainer.strategy
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
        return LoadBalancer(self.caps, self.shape.step_size, self.config.balance, self._balance_speeds)

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
            self.comm_part.load_state_dict({})  # a checkpoint without the hooks' state: each says it starts afresh
        self.progress.log("restore", {"samples_done": self.position.samples_done}, self.position.epoch,
                          self.trainer.num_updates)
        changed = self.trainer.optimizer_overrides
        if changed:
            self._notice("restore | optimizer settings from the command line replace the checkpoint's: " + ", ".join(
                f"{name} {new} (was {old})" for name, (old, new) in changed.items()))
        return path

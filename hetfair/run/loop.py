"""The training loop of one process: epochs, updates, what is due between them (logs, validation, saves),
the stopping rule and preemption.

:class:`TrainingLoop` is the loop's half of :class:`~hetfair.run.training.TrainingRun`, which builds the
parts it drives (:mod:`hetfair.run.wiring`) and reports on them (:mod:`hetfair.run.reporting`). It reads
the run's typed configuration only, never the options.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Optional

from hetfair.balance import LoadBalancer
from hetfair.checkpoint.layout import Checkpointer
from hetfair.data.epoch_updates import EpochSchedule, EpochUpdates, Update
from hetfair.data.update_shape import UpdateShape
from hetfair.errors import ConfigError, Preempted
from hetfair.launch.preemption import StopAgreement, requested_by
from hetfair.logging.meters import IntervalStats, Stopwatch
from hetfair.parallel.context import DistributedContext
from hetfair.parallel.stats import UpdateResult
from hetfair.run.config import RunConfig
from hetfair.run.reporting import RunReports
from hetfair.run.state import Position
from hetfair.run.validation import Validator
from hetfair.tasks import Task
from hetfair.trainer import Trainer


class Regroup(Exception):
    """Live recovery: every rank left the loop at the same update boundary to let the membership change."""


class TrainingLoop(RunReports):
    """Runs epochs of updates until the stopping rule holds; validates, saves and logs as the loop section says."""

    config: RunConfig
    context: DistributedContext
    task: Task
    train_data: object
    trainer: Trainer
    validator: Validator
    checkpointer: Checkpointer
    position: Position
    caps: list[int]
    """Batch sizes of the ranks that load their own samples (:attr:`data_rank` indexes them)."""
    data_rank: int
    shape: UpdateShape
    balancer: Optional[LoadBalancer]
    interval: IntervalStats
    epoch_stats: IntervalStats
    stopwatch: Stopwatch
    preemption: StopAgreement
    preempted: bool
    restored_from: Optional[Path]

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
        return EpochUpdates(self.train_data, self.task.collater, schedule, self.data_rank, self.position.epoch,
                            start=self.position.samples_done, split=self._current_split,
                            num_workers=self.config.data.num_workers, pin_memory=self.context.device.type == "cuda",
                            inner_steps=self.trainer.strategy.inner_steps,
                            pieces=self.trainer.strategy.micro_batches_per_step())

    def _current_split(self) -> Optional[list[int]]:
        """The per-rank shares of each global batch: the balancer's, else proportional to the batch sizes."""
        return list(self.balancer.split) if self.balancer is not None else None

    def train_update(self, update: Update) -> None:
        """One update (or one skipped for an fp16 overflow: the data moves on either way); its
        statistics go to the meters and the balancer (which may move the split)."""
        self._start_first_update_reports()
        result = self.trainer.train_step(update.micro_batches, rider=self.preemption)  # the stop vote rides along
        seconds = self.stopwatch.lap()
        self.position.samples_done += update.global_samples
        if result is not None:
            self._report_first_update(result)
            self.interval.add(result, seconds)
            self.epoch_stats.add(result, seconds)
            self._rebalance(result)
            self._advise_comm(result)
        # the bar's loss: of the updates since the last train_inner line, from the stats already synced
        self.progress.step(update.steps, self.interval.criterion_metrics)

    def _rebalance(self, result: UpdateResult) -> None:
        """Show the balancer this update's per-rank timings and log a new split."""
        if self.balancer is None:
            return
        split = self.balancer.observe(result.timed_samples, result.compute_seconds)
        if split is not None:
            self._log("balance", {f"split{rank}": count for rank, count in enumerate(split)})

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

    def _preemption_detail(self) -> str:
        saved = ("no checkpoint written (--no-save)" if self.checkpointer.config.no_save else
                 f"saved {self.checkpointer.config.save_dir / 'checkpoint_last.pt'}; run the same command to resume")
        return f"stopped after update {self.trainer.num_updates} (epoch {self.position.epoch}); {saved}"

    @staticmethod
    def _preemption_cause() -> str:
        signum = requested_by()
        return signal.Signals(signum).name if signum is not None else "a signal to another rank"


def _every(interval: int, num_updates: int) -> bool:
    """True every ``interval`` updates (never for 0: off)."""
    return interval > 0 and num_updates % interval == 0

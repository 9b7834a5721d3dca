"""What a training run says: the ``plan |`` table, the ``setup |`` and ``batch |`` lines, the first update's
``memory |`` table and shard report, the ``comm |`` advice, the ``done |`` summary, and the metrics of each phase
(progress output and TensorBoard).

:class:`RunReports` is the reporting half of :class:`~hetfair.run.training.TrainingRun`; the loop
(:mod:`hetfair.run.loop`) calls it. It reads the run's typed configuration and its parts, never the options.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

from hetfair.balance import LoadBalancer
from hetfair.checkpoint.layout import Checkpointer
from hetfair.data.batch_plan import split_counts
from hetfair.data.update_shape import UpdateShape
from hetfair.logging.progress import Progress, format_metric
from hetfair.logging.tensorboard import TensorBoardLogger
from hetfair.memory.table import FirstUpdateMemory, gather_rows, over_budget_lines, table_lines
from hetfair.parallel.comm_advice import CommAdvisor, LinkMeasurement
from hetfair.parallel.context import DistributedContext
from hetfair.parallel.nodes import gather_layout
from hetfair.parallel.pipeline_stage import boundary_bytes
from hetfair.parallel.stats import UpdateResult
from hetfair.plan.planner import JobPlan
from hetfair.run.config import RunConfig
from hetfair.run.state import Position, TrainingClock
from hetfair.trainer import Trainer

if TYPE_CHECKING:
    from hetfair.parallel.gradient_comm import GradientComm


class RunReports:
    """The lines and metrics a run reports; only the master prints (``_notice``), every rank joins the collectives."""

    config: RunConfig
    context: DistributedContext
    progress: Progress
    tensorboard: TensorBoardLogger
    clock: TrainingClock
    position: Position
    trainer: Trainer
    checkpointer: Checkpointer
    plan: JobPlan
    caps: list[int]
    data_rank: int
    data_groups: list[list[int]]
    precisions: list[str]
    budget: Optional[int]
    shape: UpdateShape
    nominal_shape: UpdateShape
    balancer: Optional[LoadBalancer]
    train_data: object
    model_description: str
    """``model M (arch A) | task T`` for the ``setup |`` line (:meth:`hetfair.run.wiring.RunWiring.model_description`)."""
    comm: Optional["GradientComm"]
    comm_advisor: Optional[CommAdvisor]
    _memory_to_report: Optional[FirstUpdateMemory]
    _memory_table_wanted: bool
    _can_checkpoint: bool
    _shards_to_report: bool

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

    def _show_plan(self) -> None:
        """The ``plan |`` table, where anything was ``auto`` or for ``--dry-run``."""
        if not (self.plan.automatic or self.config.loop.dry_run):
            return
        step = self.shape.step_size
        split = self.balancer.split if self.balancer is not None else split_counts(step, self.caps, self.caps)
        for line in self.plan.lines(self._by_rank(self.caps), self._by_rank([count / step for count in split])):
            self._notice(line)
        if self.config.loop.dry_run:
            self._notice("dry run | the plan above; nothing was trained or written (drop --dry-run to train)")

    def _measure_link(self) -> Optional[CommAdvisor]:
        """Time one all-reduce of the gradients' size (a collective), for the ``comm |`` line; where the
        strategy's gradients travel in one (a replicated run of several processes)."""
        if self.comm is None:
            return None
        link = LinkMeasurement(self.comm.gradient_bytes, self.comm.time_all_reduce(),
                               len(gather_layout(self.context)), self.comm.hook_costs(), self.comm.parameter_count,
                               self.context.world_size, self._boundary_bytes())
        kept = self.comm.mode if self.comm.requested == "auto" and self.comm.mode != "none" else None
        return CommAdvisor(link, self.comm.requested, kept, self.comm)

    def _by_rank(self, values: list[Any]) -> list[Any]:
        """Each rank's entry of ``values``, which are by data group (a pipeline's ranks load the same samples)."""
        by_rank: list[Any] = [None] * self.context.world_size
        for group, value in zip(self.data_groups, values):
            for rank in group:
                by_rank[rank] = value
        return by_rank

    def _boundary_bytes(self) -> float:
        """The activations a pipeline of this model would send across a stage boundary per update of this rank's
        samples (0: the model cannot be cut)."""
        model, units = self.trainer.model, getattr(self.trainer.model, "sharding_units", list)()
        per_sample = boundary_bytes(model, len(units), self.trainer.criterion, self.trainer.dummy_batch)
        return per_sample * self.caps[self.data_rank] * self.shape.steps_per_update

    def _advise_comm(self, result: UpdateResult) -> None:
        """Once the compute time is known: log the ``comm |`` lines; with ``auto``, switch to its choice."""
        advice = self.comm_advisor.observe(result.compute_seconds) if self.comm_advisor else None
        if advice is not None and self.comm is not None:
            self.comm.select(advice.chosen)
            for line in advice.lines():
                self._notice(line)

    def _start_first_update_reports(self) -> None:
        """Before the first update: start measuring its memory, where the ``memory |`` table has something to say."""
        if self._shards_to_report and self._memory_table_wanted and self._memory_to_report is None:
            self._memory_to_report = FirstUpdateMemory(self.context.device, self.trainer.optimizer)

    def _report_first_update(self, result: UpdateResult) -> None:
        """After the first update that was not skipped: the ``memory |`` table and each rank's shards (collectives)."""
        if self._shards_to_report and not result.skipped:
            if self._memory_table_wanted:
                self._report_memory(result.samples[self.context.rank])
            self._report_optimizer_shards()

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

    def _say_what_no_save_leaves_alone(self) -> None:
        config = self.checkpointer.config
        last = config.restore_path()
        if not config.resumes() and last.is_file():
            self._notice(f"restore | not resuming from {last}: a --no-save run starts afresh "
                         f"(--restore-file {last} resumes from it)")

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
        caps = ", ".join(f"rank {rank}: {cap}" for rank, cap in enumerate(self._by_rank(self.caps)))
        precisions = ", ".join(f"rank {r}: {p}" for r, p in enumerate(self.precisions))
        scaler = self.trainer.loss_scaler
        scaling = f" | loss scale {scaler.scale:g}" if scaler is not None else ""
        self.progress.info(f"setup | {self.model_description} | "
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

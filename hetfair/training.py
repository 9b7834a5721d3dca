"""The training loop of one process: epochs, updates, validation, checkpoints, logging."""

from __future__ import annotations

import argparse
import math
import random
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

import numpy as np
import torch

from hetfair.balance import BalanceConfig, LoadBalancer
from hetfair.checkpoint import CheckpointManager, load_checkpoint
from hetfair.data.batch_plan import BatchPlan
from hetfair.data.rank_batches import RankBatches, dummy_batch
from hetfair.distributed.collectives import all_gather_ints
from hetfair.distributed.context import DistributedContext
from hetfair.distributed.stats import sync_stats
from hetfair.distributed.zero import shard_report
from hetfair.errors import ConfigError
from hetfair.logging.meters import IntervalStats
from hetfair.logging.progress import Progress
from hetfair.logging.tensorboard import TensorBoardLogger
from hetfair.options import plain_config
from hetfair.tasks import TASK_REGISTRY, Task
from hetfair.trainer import Trainer, UpdateResult


@dataclass
class Position:
    """Where training stands: the current epoch (1-based) and samples of it already done."""

    epoch: int = 1
    samples_done: int = 0


def local_capacity(args: argparse.Namespace, task: Task, max_sentences: Optional[int]) -> int:
    """Samples this process takes per micro-batch, from ``--max-sentences`` and/or ``--max-tokens``."""
    capacity = max_sentences if max_sentences is not None else math.inf
    if args.max_tokens is not None:
        positions = task.max_positions()
        if positions is None:
            raise ConfigError(f"task '{args.task}' has no fixed sample length; use --max-sentences instead of --max-tokens")
        if args.max_tokens < positions:
            raise ConfigError(f"--max-tokens {args.max_tokens} is smaller than one sample ({positions} tokens)")
        capacity = min(capacity, args.max_tokens // positions)
    return int(capacity)


def train(args: argparse.Namespace, context: DistributedContext) -> None:
    """Train until ``--max-epoch`` / ``--max-update``; resumes from ``--restore-file`` if present."""
    TrainingRun(args, context).run()


class TrainingRun:
    """State of one process's training run, from set-up to the last checkpoint."""

    def __init__(self, args: argparse.Namespace, context: DistributedContext) -> None:
        self.args = args
        self.context = context
        _seed_everything(args.seed)
        self.task = TASK_REGISTRY.get(args.task).setup_task(args)
        self.train_data = self.task.dataset(args.train_subset)
        model = self.task.build_model(args)
        criterion = self.task.build_criterion(args)
        self.trainer = Trainer(args, self.task, model, criterion, context,
                               dummy_batch(self.train_data, self.task.collater))
        self.caps = all_gather_ints(context, local_capacity(args, self.task, args.max_sentences))
        valid_cap = local_capacity(args, self.task, args.max_sentences_valid or args.max_sentences)
        self.valid_caps = all_gather_ints(context, valid_cap)
        self.global_batch_size = self._global_batch_size()
        self.balancer = (LoadBalancer(self.caps, self.global_batch_size, BalanceConfig.from_args(args))
                         if args.auto_balance else None)
        self.position = Position()
        self.checkpoints = CheckpointManager(args)
        self.progress = Progress(args.log_format, enabled=context.is_master)
        self.tensorboard = TensorBoardLogger(args.tensorboard_logdir, enabled=context.is_master)
        reduce_metrics = self.trainer.criterion.reduce_metrics
        self.interval = IntervalStats(reduce_metrics)
        self.epoch_stats = IntervalStats(reduce_metrics)
        self._shards_to_report = args.zero_sharding == "os"
        self._started = time.perf_counter()
        self._wall_before = 0.0  # training seconds of earlier runs of this job (from the checkpoint)
        self._check_best_metric_exists()
        self._restore()
        self._announce(model)

    def _global_batch_size(self) -> int:
        """``--global-batch-size`` (default: the sum of the per-rank batch sizes), checked against them."""
        size = self.args.global_batch_size or sum(self.caps)
        if size > sum(self.caps):
            raise ConfigError(f"--global-batch-size {size} exceeds the per-process batch sizes {self.caps} "
                              f"together ({sum(self.caps)})")
        if self.args.auto_balance and size < len(self.caps):
            raise ConfigError(f"--auto-balance needs a --global-batch-size of at least one sample per process "
                              f"({len(self.caps)})")
        return size

    # -- the loop ----------------------------------------------------------------
    def run(self) -> None:
        try:
            while not self._finished():
                self.train_epoch()
        finally:
            self.progress.end_epoch()
            self.tensorboard.close()

    def _finished(self) -> bool:
        args = self.args
        if args.max_update and self.trainer.num_updates >= args.max_update:
            return True
        return bool(args.max_epoch) and self.position.epoch > args.max_epoch

    def train_epoch(self) -> None:
        position = self.position
        self.task.begin_epoch(position.epoch)
        steps_left = math.ceil((len(self.train_data) - position.samples_done) / self.global_batch_size)
        self.progress.start_epoch(position.epoch, steps_left, 0)
        while position.samples_done < len(self.train_data):
            if self._train_with_current_split():
                return  # --max-update reached
        self.progress.end_epoch()
        self._end_epoch()

    def _train_with_current_split(self) -> bool:
        """Train on the rest of the epoch split as the balancer says, until the epoch ends or the
        split moves (the same global batches then continue with the new split); True at --max-update."""
        args, position = self.args, self.position
        plan = BatchPlan(len(self.train_data), self.caps, args.seed, position.epoch, shuffle=True,
                         shares=self.balancer.split if self.balancer else None, start=position.samples_done,
                         global_batch_size=self.global_batch_size)
        batches = RankBatches(self.train_data, self.task.collater, plan, self.context.rank,
                              num_workers=args.num_workers, pin_memory=self.context.device.type == "cuda")
        group: list[Optional[dict[str, Any]]] = []
        group_samples = 0
        for step, sample in enumerate(batches):
            group.append(sample)
            group_samples += len(plan.global_batch(step))
            if len(group) < args.update_freq and step + 1 < plan.num_steps:
                continue
            result = self.trainer.train_step(group)
            position.samples_done += group_samples
            self.progress.step(len(group))
            if self._shards_to_report:
                self._report_optimizer_shards()
            group, group_samples = [], 0
            resplit = False
            if result is not None:
                self.interval.add(result)
                self.epoch_stats.add(result)
                resplit = self._rebalance(result)
            if step + 1 < plan.num_steps and self._after_update_mid_epoch():
                return True
            if resplit:
                return False
        return False

    def _rebalance(self, result: UpdateResult) -> bool:
        """Show the balancer this update's per-rank timings; True when it moves the split."""
        if self.balancer is None:
            return False
        split = self.balancer.observe(result.per_rank["samples"], result.per_rank["compute_seconds"])
        if split is None:
            return False
        self._log("balance", {f"split{rank}": count for rank, count in enumerate(split)})
        return True

    def _report_optimizer_shards(self) -> None:
        """Log each rank's shard and optimizer-state bytes once, after the first update (a collective)."""
        self._shards_to_report = False
        report = shard_report(self.trainer.optimizer, self.context)
        self.progress.log("zero", report, self.position.epoch, self.trainer.num_updates)

    def _after_update_mid_epoch(self) -> bool:
        """Log/validate/save as the intervals say; True when --max-update is reached."""
        args, num_updates = self.args, self.trainer.num_updates
        if num_updates % args.log_interval == 0:
            self._log("train_inner", self.interval.metrics())
            self.interval.reset()
        stop = bool(args.max_update) and num_updates >= args.max_update
        valid_metric = None
        if stop or (args.validate_interval_updates and num_updates % args.validate_interval_updates == 0):
            valid_metric = self.validate()
        if stop or (args.save_interval_updates and num_updates % args.save_interval_updates == 0):
            self.save(end_of_epoch=False, valid_metric=valid_metric)
        if stop:
            self._log("train", self.epoch_stats.metrics())
        return stop

    def _end_epoch(self) -> None:
        args = self.args
        finished_epoch = self.position.epoch
        self._log("train", self.epoch_stats.metrics())
        self.epoch_stats.reset()
        valid_metric = None
        if finished_epoch % args.validate_interval == 0 or self._last_epoch(finished_epoch):
            valid_metric = self.validate()
        self.trainer.lr_scheduler.step_epoch(finished_epoch, valid_metric)
        self.position = Position(epoch=finished_epoch + 1, samples_done=0)
        self.save(end_of_epoch=True, valid_metric=valid_metric, epoch=finished_epoch)

    def _last_epoch(self, epoch: int) -> bool:
        args = self.args
        return (bool(args.max_epoch) and epoch >= args.max_epoch) or (
            bool(args.max_update) and self.trainer.num_updates >= args.max_update
        )

    # -- validation -----------------------------------------------------------------
    def validate(self) -> Optional[float]:
        """Validate on every ``--valid-subset``; return the first one's best-checkpoint metric."""
        if self.args.disable_validation:
            return None
        first_metric = None
        for subset in self.args.valid_subset.split(","):
            metrics = self.validate_subset(subset)
            self._log(subset, metrics)
            if first_metric is None:
                first_metric = self._best_metric(metrics)
        return first_metric

    def validate_subset(self, subset: str) -> dict[str, float]:
        dataset = self.task.dataset(subset)
        plan = BatchPlan(len(dataset), self.valid_caps, self.args.seed, epoch=0, shuffle=False)
        totals: dict[str, float] = {}
        for sample in RankBatches(dataset, self.task.collater, plan, self.context.rank,
                                  num_workers=self.args.num_workers):
            if sample is None:
                continue
            for key, value in self.trainer.valid_step(sample).items():
                if isinstance(value, (int, float)):
                    totals[key] = totals.get(key, 0.0) + float(value)
        totals = _with_zero_defaults(totals, self._valid_keys(dataset))
        synced = sync_stats(self.context, totals, {})
        return self.trainer.criterion.reduce_metrics(synced.totals)

    def _valid_keys(self, dataset: Any) -> list[str]:
        """The criterion's logging keys (so a rank without validation data sends the same vector)."""
        if not hasattr(self, "_valid_key_cache"):
            self._valid_key_cache = sorted(self.trainer.valid_step(self.task.collater([dataset[0]])))
        return self._valid_key_cache

    def _check_best_metric_exists(self) -> None:
        """Fail at start-up, not after an epoch, when the best-checkpoint metric is not reported."""
        if self.args.disable_validation or self.args.no_save:
            return
        subset = self.args.valid_subset.split(",")[0]
        dataset = self.task.dataset(subset)
        self._best_metric(self.trainer.criterion.reduce_metrics(
            {key: 0.0 for key in self._valid_keys(dataset)}))

    def _best_metric(self, metrics: dict[str, float]) -> float:
        name = self.args.best_checkpoint_metric
        if name not in metrics:
            raise ConfigError(
                f"--best-checkpoint-metric {name} is not reported by the criterion; choose one of: "
                f"{', '.join(sorted(metrics))}"
            )
        return metrics[name]

    # -- checkpoints --------------------------------------------------------------------
    def save(self, end_of_epoch: bool, valid_metric: Optional[float], epoch: Optional[int] = None) -> None:
        """Write the checkpoints due now (collective: every rank calls it, rank 0 writes)."""
        if self.args.no_save:
            return
        trainer_state = self.trainer.state_dict()
        if not self.context.is_master:
            return
        epoch = epoch if epoch is not None else self.position.epoch
        names = self.checkpoints.file_names(epoch, self.trainer.num_updates, end_of_epoch, valid_metric)
        state = {
            "trainer": trainer_state,
            "position": asdict(self.position),
            "epoch_stats": self.epoch_stats.state_dict(),
            "balance": self.balancer.state_dict() if self.balancer else None,
            "rng": _rng_state(),
            "wall": self._wall(),
            "config": plain_config(self.args),
        }
        self.checkpoints.save(state, names, valid_metric)

    def _restore(self) -> None:
        path = self.checkpoints.restore_path()
        if not path.is_file():
            if self.args.restore_file != "checkpoint_last.pt":
                raise ConfigError(f"--restore-file {path} does not exist")
            return
        state = load_checkpoint(path)
        self.trainer.load_state_dict(state["trainer"], reset_optimizer=self.args.reset_optimizer)
        self.position = Position(**state["position"])
        self.epoch_stats.load_state_dict(state["epoch_stats"])
        self._restore_balance(state.get("balance"))
        self.checkpoints.best_metric = state.get("best_metric")
        _set_rng_state(state["rng"])
        self._wall_before = float(state.get("wall", 0.0))
        if self.context.is_master:
            self.progress.log("restore", {"epoch": self.position.epoch, "samples_done": self.position.samples_done},
                              self.position.epoch, self.trainer.num_updates)

    def _restore_balance(self, saved: Optional[dict[str, Any]]) -> None:
        """Continue with the saved split and measurements when balancing and they still fit this run."""
        if self.balancer is None or saved is None:
            return
        if not self.balancer.load_state_dict(saved) and self.context.is_master:
            self.progress.info(f"restore | saved split {saved['split']} does not fit this run's batch sizes "
                               f"{self.caps} and global batch {self.global_batch_size}: balancing starts afresh")

    # -- logging -----------------------------------------------------------------------
    def _wall(self) -> float:
        return self._wall_before + time.perf_counter() - self._started

    def _log(self, phase: str, metrics: dict[str, float]) -> None:
        if not metrics:
            return
        if phase.startswith("train"):
            metrics = {**metrics, "wall": self._wall()}
        self.progress.log(phase, metrics, self.position.epoch, self.trainer.num_updates)
        self.tensorboard.log(phase, metrics, self.trainer.num_updates)

    def _announce(self, model: torch.nn.Module) -> None:
        if not self.context.is_master:
            return
        parameters = sum(p.numel() for p in model.parameters())
        self.progress.log("setup", {"parameters": parameters, "world_size": self.context.world_size,
                                    "global_batch": self.global_batch_size, "train_samples": len(self.train_data)},
                          self.position.epoch, self.trainer.num_updates)
        caps = ", ".join(f"rank {r}: {c}" for r, c in enumerate(self.caps))
        config_file = getattr(self.args, "config_file", None)  # e.g. BERT's config decides the size
        shape = f"config {config_file}" if config_file else f"arch {self.args.arch}"
        self.progress.info(f"setup | model {self.args.model} ({shape}) | task {self.args.task} | "
                             f"per-rank batch {caps} | device {self.context.device}")


def _with_zero_defaults(totals: dict[str, float], keys: list[str]) -> dict[str, float]:
    return {**{key: 0.0 for key in keys}, **totals}


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _rng_state() -> dict[str, Any]:
    numpy_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": torch.from_numpy(numpy_state[1].astype(np.int64)),
        "numpy_pos": int(numpy_state[2]),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"]))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])

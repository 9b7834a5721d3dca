"""Validation: a model's metrics on a split, computed the same way in training and in ``hetfair-validate``."""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
from torch import nn

from hetfair.criteria import HetfairCriterion
from hetfair.data.batch_plan import BatchPlan
from hetfair.data.rank_batches import RankBatches
from hetfair.parallel.context import DistributedContext
from hetfair.parallel.stats import sum_logs, sync_stats
from hetfair.tasks import Task
from hetfair.utils import move_to_device

if TYPE_CHECKING:
    from hetfair.parallel.pipeline import PipelineRun


class Validator:
    """Sums the criterion's logs over a split, in order, each rank taking its share of every batch.

    ``caps[r]`` is rank ``r``'s validation batch size (one entry on a single process). The
    sums of all ranks are added in one all-reduce and reduced by the criterion to metrics. With
    ``forward_every_batch`` (a fully sharded model) a rank without samples in a batch still runs a
    forward, uncounted, to join the parameter gathers of the others.
    """

    def __init__(self, task: Task, model: nn.Module, criterion: HetfairCriterion, context: DistributedContext,
                 caps: Sequence[int], num_workers: int = 0, forward_every_batch: bool = False,
                 data_rank: Optional[int] = None, runner: Optional["PipelineRun"] = None) -> None:
        self.task = task
        self.model = model
        self.criterion = criterion
        self.context = context
        self.caps = list(caps)
        self.num_workers = num_workers
        self.forward_every_batch = forward_every_batch  # a fully sharded model gathers in every forward
        self.data_rank = context.rank if data_rank is None else data_rank
        """Which share of each batch this rank loads (``caps`` are indexed by it: a pipeline's ranks share one)."""
        self.runner = runner
        """Where a pipeline runs the model: the criterion's logs come from its last stage."""
        self._log_keys: list[str] | None = None

    @torch.no_grad()
    def metrics(self, split: str) -> dict[str, float]:
        """The criterion's metrics on ``split`` (a collective when distributed)."""
        dataset = self.task.dataset(split)
        totals = dict.fromkeys(self.log_keys(split), 0.0)  # a rank without data sends the same keys
        plan = BatchPlan(len(dataset), self.caps, seed=0, epoch=0, shuffle=False,
                         sizes=getattr(dataset, "sizes", None))
        batches = RankBatches(dataset, self.task.collater, plan, self.data_rank, num_workers=self.num_workers,
                              pin_memory=self.context.device.type == "cuda")
        for sample in batches:
            if sample is not None:
                sum_logs(totals, self._logs(sample))
            elif self.forward_every_batch:
                self._logs(self.task.collater([dataset[0]]))  # joins the other ranks' collectives; not counted
        synced = sync_stats(self.context, totals, {})
        return self.criterion.reduce_metrics(synced.totals)

    def log_keys(self, split: str) -> list[str]:
        """The keys the criterion logs (seen on the first sample of ``split``), ``sample_size`` included."""
        if self._log_keys is None:
            dataset = self.task.dataset(split)
            with torch.no_grad():
                logs = self._logs(self.task.collater([dataset[0]]))
            self._log_keys = sorted(self.runner.agree_keys(logs) if self.runner is not None else logs)
        return self._log_keys

    def _logs(self, sample: dict[str, Any]) -> dict[str, Any]:
        self.model.eval()
        self.criterion.eval()
        sample = move_to_device(sample, self.context.device)
        if self.runner is not None:
            return self._pipelined_logs(sample, self.runner)
        _, sample_size, logs = self.criterion(self.model, sample)
        return {**logs, "sample_size": float(sample_size)}

    def _pipelined_logs(self, sample: dict[str, Any], runner: "PipelineRun") -> dict[str, Any]:
        """The logs of ``sample`` through a pipeline: the criterion's on its last stage, none elsewhere."""
        found: dict[str, Any] = {}

        def loss_of(output: Any, index: int) -> torch.Tensor:
            loss, sample_size, logs = self.criterion(lambda **inputs: output, sample)
            found.update(logs, sample_size=float(sample_size))
            return loss

        runner.run([self.criterion.model_inputs(sample)], loss_of, nullcontext, train=False)
        return found

"""Running an update's micro-batches through a pipeline with ``torch.distributed.pipelining``.

torch's schedules (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``) do the work;
this module feeds them. Each stage is built in torch's *static* mode, its boundary shapes given
by the model family (:meth:`PipelineStage.boundary`), so stages exchange tensors only: the
dynamic mode would send pickled shape metadata between ranks, and hetfair unpickles nothing a
peer sends. Static shapes mean one ``PipelineStage`` per micro-batch shape: an update's
micro-batches are first made one shape where the family can (BERT pads them to the longest,
:meth:`PipelineStage.one_shape`), then run in groups of one shape (usually one group), each
group one schedule step, gradients accumulating over the groups. Every stage gets each
micro-batch's model inputs (the same samples load on every stage of a pipeline); the criterion
runs on the last stage, whose summed losses the schedule backpropagates unscaled
(``scale_grads=False``): the trainer normalises by the global sample count, as in every mode.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Sequence

import torch
import torch.distributed as dist
from torch import nn

from hetfair.parallel.pipeline_stage import PipelineStage as ModelStage
from hetfair.parallel.collectives import all_gather_json
from hetfair.parallel.context import DistributedContext

LossOf = Callable[[Any, int], torch.Tensor]
"""The last stage's loss of micro-batch ``index`` of the current group, given its output."""

_CACHED_SHAPES = 8
"""Micro-batch shapes whose stages and schedule are kept (a new shape builds new ones, without communication)."""


class _Autocast(nn.Module):
    """A stage part whose forward runs in the trainer's autocast context (set for each step)."""

    def __init__(self, part: ModelStage) -> None:
        super().__init__()
        self.part = part
        self.context: Callable[[], ContextManager[Any]] = nullcontext

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.context():
            output = self.part(*args, **kwargs)
        return _LastOutput(output) if isinstance(output, dict) else output


class _LastOutput(dict):  # type: ignore[type-arg]
    """A last stage's output that is a dict of tensors (BERT's scores), as torch's schedules handle an output
    tensor: after the backward they detach it in place unless it is a view; here each of its tensors."""

    def _is_view(self) -> bool:
        return False

    def detach_(self) -> "_LastOutput":
        for value in self.values():
            if isinstance(value, torch.Tensor) and not value._is_view():
                value.detach_()
        return self


class PipelineRunner:
    """This rank's stages of one pipeline and the schedule that runs them.

    ``parts`` are this rank's stage modules (stage indices ``stage_indices`` of ``num_stages``), and
    ``modules`` the same with their forward in the trainer's autocast (:meth:`wrap_autocast`).
    """

    def __init__(self, parts: Sequence[ModelStage], modules: Sequence[nn.Module], stage_indices: Sequence[int],
                 num_stages: int, schedule: str, group: dist.ProcessGroup, context: DistributedContext) -> None:
        self.parts = list(parts)
        self.modules = list(modules)
        self.stage_indices = list(stage_indices)
        self.num_stages = num_stages
        self.schedule_name = schedule
        self.group = group
        self.context = context
        self.group_size = dist.get_world_size(group)
        self._schedules: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._loss: LossOf = _no_loss
        self._keys: list[str] | None = None

    @property
    def holds_last_stage(self) -> bool:
        """Whether this rank computes the loss (its logs and sample counts are the pipeline's)."""
        return self.num_stages - 1 in self.stage_indices

    @staticmethod
    def wrap_autocast(part: ModelStage) -> nn.Module:
        """``part`` with the forward context :meth:`run` sets."""
        return _Autocast(part)

    def run(self, inputs: Sequence[dict[str, Any]], loss: LossOf, forward_context: Callable[[], ContextManager[Any]],
            train: bool = True) -> None:
        """Forward (and with ``train``, backward) of micro-batches with model ``inputs``; ``loss(output, i)`` on
        the last stage gives micro-batch ``i``'s summed loss. Micro-batches of one shape run in one schedule step."""
        for module in self.modules:
            _autocast_of(module).context = forward_context
        inputs = self.parts[0].one_shape(inputs)  # every rank of the pipeline pads the same micro-batches alike
        for indices in _by_shape(inputs):
            self._loss = lambda output, target, _indices=indices: loss(output, _indices[int(target[0])])
            group = [inputs[index] for index in indices]
            schedule = self._schedule(group)
            kwargs = _concatenated(group)
            target = torch.arange(len(group), device=self.context.device)
            if train:
                schedule.step(target=target, return_outputs=False, **kwargs)
            else:
                schedule.eval(target=target, **kwargs)

    def agree_keys(self, logs: dict[str, Any]) -> dict[str, Any]:
        """``logs`` with every key any rank's logs have (zeros where missing), so that a packed all-reduce sums
        them: only the last stages compute the criterion's logs. The keys are exchanged once (JSON)."""
        if self._keys is None or not set(logs) <= set(self._keys):
            if self.context.is_distributed:
                self._keys = sorted({key for keys in all_gather_json(self.context, sorted(logs)) for key in keys})
            else:
                self._keys = sorted(logs)
        return {key: logs.get(key, 0.0) for key in self._keys}

    # -- torch's stages and schedules ---------------------------------------------------------
    def _schedule(self, group: Sequence[dict[str, Any]]) -> Any:
        key = (len(group), *_signature(group[0]))
        if key in self._schedules:
            self._schedules.move_to_end(key)
            return self._schedules[key]
        schedule = self._build(group)
        self._schedules[key] = schedule
        if len(self._schedules) > _CACHED_SHAPES:
            self._schedules.popitem(last=False)
        return schedule

    def _build(self, group: Sequence[dict[str, Any]]) -> Any:
        from torch.distributed import pipelining

        boundary = tuple(tensor.requires_grad_(tensor.is_floating_point())  # gradients flow back across boundaries
                         for tensor in self.parts[0].boundary(group[0]))
        stages = [pipelining.PipelineStage(
            module, index, self.num_stages, self.context.device,
            input_args=() if index == 0 else boundary, output_args=boundary, group=self.group)
            for module, index in zip(self.modules, self.stage_indices)]
        count = len(group)
        loss_fn = self._loss_fn
        if len(stages) > 1:  # interleaved: two stages per rank
            fits = count >= self.group_size and count % self.group_size == 0
            kind = pipelining.ScheduleInterleaved1F1B if fits else pipelining.ScheduleLoopedBFS
            return kind(stages, count, loss_fn=loss_fn, scale_grads=False)
        kind = pipelining.Schedule1F1B if self.schedule_name == "1f1b" and count >= self.num_stages \
            else pipelining.ScheduleGPipe  # 1F1B needs a micro-batch per stage: fewer run as GPipe (same update)
        return kind(stages[0], count, loss_fn=loss_fn, scale_grads=False)

    def _loss_fn(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        return self._loss(output, target)


def _autocast_of(module: nn.Module) -> _Autocast:
    assert isinstance(module, _Autocast)
    return module


def _no_loss(output: Any, index: int) -> torch.Tensor:
    raise AssertionError("a pipeline step ran without a loss")


def _signature(inputs: dict[str, Any]) -> tuple[Any, ...]:
    """What decides a micro-batch's stage shapes: each input's name, shape and dtype."""
    return tuple((name, tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else (name, value)
                 for name, value in sorted(inputs.items()))


def _by_shape(inputs: Sequence[dict[str, Any]]) -> list[list[int]]:
    """The micro-batch indices grouped by :func:`_signature`, groups in order of their first micro-batch."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for index, item in enumerate(inputs):
        groups.setdefault(_signature(item), []).append(index)
    return list(groups.values())


def _concatenated(group: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The micro-batches' inputs as one batch (the schedule cuts it back along dim 0 into as many equal parts)."""
    return {name: torch.cat([item[name] for item in group]) if isinstance(value, torch.Tensor) else value
            for name, value in group[0].items()}

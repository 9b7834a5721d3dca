"""``--ddp-backend pipeline``: the model cut into stages at its layers, one stage per rank of a pipeline.

Over a slow link, every other mode sends the model's size in bytes per update (gradients,
parameters or pseudo-gradients); a pipeline sends only the activations at its stage
boundaries. The world's ranks form ``world / S`` pipelines of ``S`` ranks (``--pipeline-stages``),
laid out by ``--pipeline-layout``; the stages of one pipeline load the same samples, and each
pipeline its own share of every step (:meth:`data_groups`). Inside a pipeline, torch's schedules
run the micro-batches (:mod:`hetfair.parallel.pipeline_schedule`); across pipelines, each stage's
gradients are summed over its replicas in one all-reduce after the update's last schedule step. Not
DDP: its reducer synchronises at the end of every schedule step, and pipelines whose micro-batches
come in different shapes (one step per shape) run different numbers of steps, so their all-reduces
would not line up. The update stays hetfair's: the criterion's summed losses on the last stage, the
global sample count, one loss scale. A parameter the first and last stage share (tied embeddings)
is the last stage's, lent to the first by rows (:mod:`hetfair.parallel.pipeline_tied`). Checkpoints
hold the whole model and optimizer in the plain format (:mod:`hetfair.parallel.pipeline_state`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from hetfair.errors import ConfigError
from hetfair.parallel import cost_model, register_strategy
from hetfair.parallel.collectives import all_gather_ints, comm_device
from hetfair.parallel.config import ParallelConfig
from hetfair.parallel.context import DistributedContext
from hetfair.parallel.pipeline_schedule import LossOf, PipelineRunner
from hetfair.parallel.pipeline_stage import PipelineStage as ModelStage
from hetfair.parallel.pipeline_split import (
    balanced_split,
    check_split_text,
    check_stages,
    even_split,
    parse_split,
    pipelines,
    stage_capacities,
    stage_count,
    stage_rates,
    unit_ranges,
)
from hetfair.parallel.pipeline_state import gather_model_state, gather_optimizer_state, local_optimizer_state
from hetfair.parallel.pipeline_tied import BorrowedWeight, TiedWeights, sum_into_grads
from hetfair.parallel.strategy import Strategy, refusal_of_backend


@register_strategy("pipeline")
class PipelineStrategy(Strategy):
    """torch.distributed.pipelining's schedules over the stages of each pipeline, gradients summed across the
    pipelines."""

    owned_flags = ("--pipeline-stages", "--pipeline-schedule", "--pipeline-microbatches", "--pipeline-split",
                   "--pipeline-layout")
    compile_refusal = ("--compile cannot trace --ddp-backend pipeline's stages (torch's schedules call each stage "
                       "per micro-batch); drop --compile")

    @classmethod
    def check_world(cls, config: ParallelConfig, world_size: int) -> None:
        if world_size % config.pipeline_stages:
            raise ConfigError(f"--pipeline-stages {config.pipeline_stages} does not divide the job's {world_size} "
                              f"processes; start a multiple of {config.pipeline_stages} processes or change "
                              f"--pipeline-stages")

    @classmethod
    def check_options(cls, config: ParallelConfig) -> None:
        check_split_text(config.pipeline_split, stage_count(config.pipeline_stages, config.pipeline_schedule))

    @classmethod
    def live_recovery_refusal(cls, config: ParallelConfig) -> Optional[str]:
        return refusal_of_backend(config, "a lost process takes its stage's layers with it, which no other "
                                          "process holds")

    @classmethod
    def cost_variants(cls, name: str, job: cost_model.Job) -> list[ParallelConfig]:
        """One stage per node over several nodes (else one per rank), 2 and 4 micro-batches a stage, the layers
        split evenly and, where the stages' devices differ in speed, by speed."""
        stages = job.nodes if job.nodes > 1 else job.world
        if job.model.boundary_bytes == 0 or stages < 2 or job.world % stages or job.model.units - 1 < stages:
            return []
        speeds = {rank.seconds_per_sample for rank in job.ranks}
        splits = ("even", "auto") if len(speeds) > 1 else ("even",)
        return [ParallelConfig(name, pipeline_stages=stages, pipeline_microbatches=factor * stages,
                               pipeline_split=how) for factor in (2, 4) for how in splits]

    @classmethod
    def predict(cls, config: ParallelConfig, job: cost_model.Job) -> cost_model.UpdateCost:
        units, stages = job.model.units - 1, config.pipeline_stages
        pipes = pipelines(job.world, stages, config.pipeline_layout)
        speeds = [1 / rank.seconds_per_sample for rank in job.ranks]
        counts = parse_split(config.pipeline_split, units, stages) or (
            balanced_split(units, stage_rates(speeds, pipes, stages), [units] * stages)
            if config.pipeline_split == "auto" else even_split(units, stages))
        return cost_model.pipeline(job, stages, config.pipeline_microbatches, [count / units for count in counts])

    @classmethod
    def wants_rank_speeds(cls, config: ParallelConfig) -> bool:
        return config.pipeline_split == "auto"

    @classmethod
    def data_groups(cls, config: ParallelConfig, world_size: int) -> list[list[int]]:
        """Each pipeline's ranks: they load the same samples."""
        return pipelines(world_size, config.pipeline_stages, config.pipeline_layout)

    def __init__(self, config: ParallelConfig, context: DistributedContext) -> None:
        super().__init__(config, context)
        self.pipes = pipelines(context.world_size, config.pipeline_stages, config.pipeline_layout)
        self.pipe = next(index for index, ranks in enumerate(self.pipes) if context.rank in ranks)
        self.position = self.pipes[self.pipe].index(context.rank)
        self.num_stages = stage_count(config.pipeline_stages, config.pipeline_schedule)
        self.stage_indices = list(range(self.position, self.num_stages, config.pipeline_stages))
        self._pipe_group, self._replica_group, self._tied_group = self._groups()
        self.microbatches = self._agreed_microbatches()
        self.parts: list[ModelStage] = []
        self.runner: Optional[PipelineRunner] = None
        self.tied = TiedWeights(context, None, None, [], [], [], None)
        """This rank's part in keeping the parameters two stages share (tied embeddings) equal."""
        self._model: nn.Module = nn.Module()  # the whole model: this rank's tensors real, the others' on meta
        self._counted_once: list[bool] = []  # per param: counted in the clipping norm on this rank
        self._full_keys: list[str] = []
        self._shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._owners: dict[str, int] = {}
        self._full_index: dict[int, int] = {}
        self._num_full = 0
        self._stage_bytes: list[int] = []
        self._output_work = 0.0
        self.split: list[int] = []

    def _groups(self) -> tuple[Any, Any, Any]:
        """This rank's pipeline and its stage's replicas (the two dimensions of a device mesh whose rows are the
        pipelines), and its pipeline's first-and-last pair; ``None`` where one process is the whole group. Every
        rank creates every group, in the same order."""
        if not self.context.is_distributed:
            return None, None, None
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh(self.context.device.type, torch.tensor(self.pipes), mesh_dim_names=("replica", "stage"))
        tied = [dist.new_group([ranks[0], ranks[-1]]) for ranks in self.pipes]
        replicas = mesh.get_group("replica") if len(self.pipes) > 1 else None
        return mesh.get_group("stage"), replicas, tied[self.pipe]

    def _agreed_microbatches(self) -> int:
        """This pipeline's ``--pipeline-microbatches``: its processes must agree (pipelines may differ)."""
        every = all_gather_ints(self.context, self.config.pipeline_microbatches)
        self.every_microbatches = [every[ranks[0]] for ranks in self.pipes]
        mine = [every[rank] for rank in self.pipes[self.pipe]]
        if len(set(mine)) > 1:
            given = ", ".join(f"{value} on rank {rank}" for rank, value in zip(self.pipes[self.pipe], mine))
            raise ConfigError(f"the processes of one pipeline were given different --pipeline-microbatches ({given}); "
                              f"give a pipeline's processes the same value")
        return mine[0]

    # -- the model ----------------------------------------------------------------------------
    def shard(self, model: nn.Module, units: Sequence[nn.Module]) -> None:
        name = type(model).__name__
        check_stages(len(units), self.num_stages, name, self.config.pipeline_schedule)
        cut = getattr(model, "pipeline_stage", None)  # a HetfairModel's
        if cut is None or cut(range(0, 1), first=True, last=False) is None:
            raise ConfigError(f"--ddp-backend pipeline: model {name} cannot be cut into stages (its family defines "
                              f"no pipeline_stage); use another --ddp-backend")
        counts = self._split(model, units, cut)
        stages = [cut(units_range, first=index == 0, last=index == self.num_stages - 1)
                  for index, units_range in enumerate(unit_ranges(counts))]
        self.split = counts
        self._output_work = stages[-1].output_work()
        self._stage_bytes = [_parameter_bytes(stage) for stage in stages]  # type: ignore[arg-type]
        self._index_state(model, stages)  # type: ignore[arg-type]
        self.parts = [stages[index] for index in self.stage_indices]  # type: ignore[misc]
        held = {id(param) for part in self.parts for param in part.parameters()}
        holders: dict[int, int] = {}
        for stage in stages:
            for param in _unique(list(stage.parameters())):
                holders[id(param)] = holders.get(id(param), 0) + 1
        tied = _unique([param for part in self.parts for param in part.parameters() if holders[id(param)] > 1])
        self.tied = self._tie(stages, tied)
        dense = {id(param) for param in self.tied.dense}
        self._counted_once = [id(param) not in dense or 0 in self.stage_indices for param in self.model_params()]
        _drop_others(model, held)
        self._model = model

    def _split(self, model: nn.Module, units: Sequence[nn.Module], cut: Callable[..., ModelStage]) -> list[int]:
        given = parse_split(self.config.pipeline_split, len(units), self.num_stages)
        if given is not None:
            return given
        if self.config.pipeline_split == "even":
            return even_split(len(units), self.num_stages)
        last = cut(range(len(units) - 1, len(units)), first=False, last=True)
        return balanced_split(len(units), self._stage_rates(), self._stage_capacities(model, units),
                              (0.0, last.output_work()))

    def _tie(self, stages: Sequence[ModelStage], tied: list[nn.Parameter]) -> TiedWeights:
        """This rank's part in keeping the parameters two stages share equal (:mod:`hetfair.parallel.pipeline_tied`):
        by rows where the family says which rows a micro-batch looks up, else by summing whole gradients."""
        first, last = stages[0], self.num_stages - 1
        pair = self.pipes[self.pipe][0], self.pipes[self.pipe][last % self.config.pipeline_stages]
        if not tied or not self.context.is_distributed:
            return TiedWeights(self.context, None, None, [], [], [], None)
        if type(first).tied_rows is ModelStage.tied_rows:
            return TiedWeights(self.context, None, self._tied_group, [], [], tied, None)
        if last in self.stage_indices:
            return TiedWeights(self.context, pair[0], None, tied, [], [], first)
        keys = {id(value): key for key, value in first.state_dict(keep_vars=True).items()}
        borrowed = [BorrowedWeight.take(keys[id(param)], param, self.parts) for param in tied]
        return TiedWeights(self.context, pair[1], None, [], borrowed, [], first)

    def _stage_rates(self) -> list[float]:
        return stage_rates(self.config.rank_speeds or (1.0,) * self.context.world_size, self.pipes, self.num_stages)

    def _stage_capacities(self, model: nn.Module, units: Sequence[nn.Module]) -> list[int]:
        ratio = 2 + self.config.optimizer_ratio  # parameters, gradients and the optimizer's state
        unit = max(_parameter_bytes(unit) for unit in units) * ratio
        ends = (_parameter_bytes(model) - sum(_parameter_bytes(unit) for unit in units)) * ratio
        return stage_capacities(self.config.rank_budgets or (None,) * self.context.world_size, self.pipes,
                                self.num_stages, unit, ends, len(units))

    def _index_state(self, model: nn.Module, stages: Sequence[ModelStage]) -> None:
        """Which rank of the first pipeline sends each key of the whole state dict, and each parameter's index
        in the whole model's order (the plain optimizer format's)."""
        full = model.state_dict(keep_vars=True)
        self._full_keys = list(full)
        self._shapes = {key: (value.shape, value.dtype) for key, value in full.items()}
        held = [{id(value) for value in stage.state_dict(keep_vars=True).values()} for stage in stages]
        for key, value in full.items():  # a tensor two stages hold comes from the last, which owns it
            stage = max(index for index, ids in enumerate(held) if id(value) in ids)
            self._owners[key] = self.pipes[0][stage % self.config.pipeline_stages]
        params = [param for param in model.parameters() if param.requires_grad]
        self._full_index = {id(param): index for index, param in enumerate(params)}
        self._num_full = len(params)

    def to_device(self, model: nn.Module) -> nn.Module:
        moved = nn.ModuleList(self.parts).to(self.context.device)
        self.tied.to(self.context.device)
        return moved

    def wrap(self, model: nn.Module) -> nn.Module:
        modules = [PipelineRunner.wrap_autocast(part) for part in self.parts]
        group = self._pipe_group if self._pipe_group is not None else dist.group.WORLD
        self.runner = PipelineRunner(self.parts, modules, self.stage_indices, self.num_stages,
                                     self.config.pipeline_schedule, group, self.context)
        return nn.ModuleList(modules)

    # -- one update ---------------------------------------------------------------------------
    def micro_batches_per_step(self) -> int:
        return self.microbatches

    def micro_batch_runner(self) -> Optional["PipelineRun"]:
        return PipelineRun(self)

    def agree_on_overflow(self, found_inf: torch.Tensor) -> None:
        if self.context.is_distributed:
            flag = found_inf.to(comm_device(self.context))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            found_inf.copy_(flag)

    def normalising_factor(self, total_sample_size: float, rank_sample_sizes: Sequence[float]) -> float:
        return 1.0 / total_sample_size  # the gradients are summed over the replicas (sum_gradients)

    def sum_gradients(self, inputs: Sequence[dict[str, Any]]) -> None:
        """After an update's schedule steps (of micro-batches with model ``inputs``): the parameters two stages
        share get the other copy's gradient, then each stage's gradients are summed over its replicas."""
        self.tied.sum_gradients(inputs)
        if self._replica_group is not None:
            sum_into_grads(_unique(self.model_params()), self._replica_group, self.context)

    def clip_grad_norm(self, params: Sequence[nn.Parameter], grads: list[torch.Tensor], owed: float,
                       clip_norm: float) -> tuple[float, float]:
        own = [param.grad for param, counted in zip(self.model_params(), self._counted_once)
               if counted and param.grad is not None]
        squares = torch.stack([norm.double() ** 2 for norm in torch._foreach_norm(own)]).sum() if own \
            else torch.zeros((), dtype=torch.float64)
        if self._pipe_group is not None:
            squares = squares.to(comm_device(self.context))
            dist.all_reduce(squares, group=self._pipe_group)
        gnorm = math.sqrt(float(squares)) * owed
        if clip_norm > 0:
            return gnorm, owed * min(1.0, clip_norm / (gnorm + 1e-6))
        return gnorm, owed

    def model_params(self) -> list[nn.Parameter]:
        return [param for part in self.parts for param in part.parameters()]

    def plan_lines(self, caps: Sequence[int]) -> list[str]:
        """One line per stage: its layers, ranks, predicted seconds per micro-batch (with measured speeds) and the
        state its parameters need (parameters, gradients, optimizer state)."""
        speeds, ratio = self.config.rank_speeds, self.config.optimizer_ratio
        ranges = unit_ranges(self.split)
        rates = self._stage_rates()
        lines = []
        for stage, units in enumerate(ranges):
            position = stage % self.config.pipeline_stages
            ranks = [pipe[position] for pipe in self.pipes]
            samples = max(cap / count for cap, count in zip(caps, self.every_microbatches))
            output = self._output_work if stage == self.num_stages - 1 else 0.0
            share = (len(units) + output) / (sum(self.split) + self._output_work)
            timing = f"{samples * share / rates[stage] * 1000:.1f} ms per micro-batch of {samples:g} (predicted)" \
                if speeds else "time not measured (--pipeline-split auto measures it)"
            state = self._stage_bytes[stage] * (2 + ratio) if ratio else self._stage_bytes[stage] * 2
            lines.append(f"plan | pipeline stage {stage}: layers {units.start}-{units.stop - 1} ({len(units)}) on "
                         f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} | {timing} | state "
                         f"{state / 2**20:.1f} MiB")
        return lines

    # -- checkpoint state ---------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        own = {key: value for key, value in self._model.state_dict().items() if not value.is_meta}
        return gather_model_state(self._full_keys, self._shapes, self._owners, own, self.context)

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        missing = [key for key in self._full_keys if key not in state]
        unexpected = [key for key in state if key not in self._owners]
        if missing or unexpected:
            raise RuntimeError(f"Error(s) in loading state_dict: missing keys {missing[:3]}, unexpected keys "
                               f"{unexpected[:3]}")
        for part in self.parts:
            part.load_state_dict({key: state[key] for key in part.state_dict()})
        self.tied.load(state)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                             params: Sequence[nn.Parameter]) -> Optional[dict[str, Any]]:
        full_index = [self._full_index[id(param)] for param in params]
        return gather_optimizer_state(optimizer, full_index, self._num_full, self.pipe == 0, self.context)

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  params: Sequence[nn.Parameter], state: dict[str, Any]) -> None:
        full_index = [self._full_index[id(param)] for param in params]
        optimizer.load_state_dict(local_optimizer_state(state, full_index))

    # -- memory ---------------------------------------------------------------------------------
    def state_shares(self, rank: int) -> tuple[float, float]:
        share = self._stage_share(rank)
        return share, share

    def _stage_share(self, rank: int) -> float:
        """The share of the model's units a rank's stages hold (the embeddings and head not counted)."""
        if not getattr(self, "split", None):
            return 1.0
        position = next(ranks.index(rank) for ranks in self.pipes if rank in ranks)
        mine = sum(self.split[index] for index in range(position, self.num_stages, self.config.pipeline_stages))
        return mine / sum(self.split)


class PipelineRun:
    """What the trainer and the validator need of a pipeline for one batch of micro-batches."""

    def __init__(self, strategy: PipelineStrategy) -> None:
        self.strategy = strategy

    @property
    def computes_loss(self) -> bool:
        """Whether this rank's logs and sample counts are the pipeline's (it holds the last stage)."""
        assert self.strategy.runner is not None
        return self.strategy.runner.holds_last_stage

    def run(self, inputs: Sequence[dict[str, Any]], loss: LossOf,
            forward_context: Callable[[], ContextManager[Any]], train: bool = True) -> None:
        assert self.strategy.runner is not None
        self.strategy.tied.refresh(inputs)
        self.strategy.runner.run(inputs, loss, forward_context, train)
        if train:
            self.strategy.sum_gradients(inputs)

    def agree_keys(self, logs: dict[str, Any]) -> dict[str, Any]:
        assert self.strategy.runner is not None
        return self.strategy.runner.agree_keys(logs)


def _unique(params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
    """``params`` without repeats (one rank's two interleaved stages may hold the same tied parameter)."""
    seen: set[int] = set()
    unique = []
    for param in params:
        if id(param) not in seen:
            seen.add(id(param))
            unique.append(param)
    return unique


def _parameter_bytes(module: nn.Module) -> int:
    return sum(param.numel() * param.element_size() for param in module.parameters())


def _drop_others(model: nn.Module, held: set[int]) -> None:
    """Move the parameters this rank's stages do not hold to the meta device (their shapes stay known; a parameter
    two modules share stays shared)."""
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) not in held:
                if id(param) not in replaced:
                    replaced[id(param)] = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
                module._parameters[name] = replaced[id(param)]

"""``--ddp-backend fully_sharded --shard-fractions F0,F1,...``: full sharding with a fraction per rank.

The same mode as :mod:`hetfair.parallel.fully_sharded` (gradients sharded, so each rank
normalises its own shards, the ranks agree on an overflow, the clipping norm is a
collective), on hetfair's own engine (:mod:`hetfair.parallel.uneven_engine`) instead of
FSDP2, which shards only evenly. Any ``--shard-fractions``, equal ones included, picks
this engine; without them the job runs on FSDP2. Gradients are reduce-scattered (summed)
in every micro-batch's backward, so a rank never holds more than its shards of them;
the sum over micro-batches is the same sum.

Checkpoints hold the plain, full state of any other mode (gathered to the master one
tensor at a time) and load by slicing each full tensor, so they move between fractions,
world sizes, FSDP2, ZeRO-1 and unsharded runs.

``--offload 1`` (per process): this rank's shards, their gradients and its optimizer
state stay in host memory; each gather copies the shard to the CUDA device for compute.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from hetfair.errors import ConfigError
from hetfair.memory.sizes import format_size
from hetfair.parallel.collectives import all_gather_ints
from hetfair.parallel.config import ParallelConfig
from hetfair.parallel.context import DistributedContext
from hetfair.parallel.sharded_gradients import REDUCE_DTYPES, ShardedGradientsStrategy
from hetfair.parallel.uneven_engine import UnevenShardedModel, gather_param


class UnevenShardedStrategy(ShardedGradientsStrategy):
    """Each rank keeps its ``--shard-fractions`` share of every parameter, its gradient and optimizer state."""

    compile_refusal = ("--compile cannot trace the uneven engine's gather hooks (--shard-fractions or budgets): "
                       "drop --compile, or the fractions to shard evenly on FSDP2")

    def __init__(self, config: ParallelConfig, context: DistributedContext) -> None:
        super().__init__(config, context)
        if config.offload and context.device.type != "cuda":
            raise ConfigError(f"--offload 1 keeps rank {context.rank}'s shards in host memory for a CUDA device, but "
                              f"it computes on {context.device.type}: give it --offload 0")
        self.engine: Optional[UnevenShardedModel] = None

    @classmethod
    def builds_deferred(cls, config: ParallelConfig) -> bool:
        return True  # each rank materialises only its slices (hetfair.models.deferred_init.full_value)

    @property
    def fractions(self) -> tuple[float, ...]:
        assert self.config.shard_fractions is not None
        return self.config.shard_fractions

    def shard(self, model: nn.Module, units: Sequence[nn.Module]) -> None:
        storage = torch.device("cpu") if self.config.offload else self.context.device
        self.engine = UnevenShardedModel(model, units, self.fractions, self.context.rank, self.context.device,
                                         storage, self.config.reshard_after_forward,
                                         REDUCE_DTYPES[self.config.reduce_dtype])

    def to_device(self, model: nn.Module) -> nn.Module:
        if not self.config.offload:
            return model.to(self.context.device)
        for module in model.modules():  # the buffers only: the shards stay in host memory
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(self.context.device)
        return model

    def largest_gathered_unit_bytes(self) -> int:
        assert self.engine is not None
        return max((unit.full_bytes for unit in self.engine.units), default=0)

    def plan_lines(self, caps: Sequence[int]) -> list[str]:
        """How the units travel: the gather the start-up probe chose (with both timings) and the reduction."""
        assert self.engine is not None
        times = self.engine.gather_seconds
        reduction = "all-reduce" if times else "padded reduce-scatter"
        probe = f" (start-up probe of a {format_size(4 * self.engine.probe_elements)} fp32 unit: " + ", ".join(
            f"{name} {seconds * 1000:.1f} ms" for name, seconds in times.items()) + ")" if times else ""
        return [f"plan | uneven shards: units gathered by {self.engine.gather_name}{probe}, gradients reduced by "
                f"{reduction}; the next unit's gather and the last unit's reduction run beside the compute"]

    # -- one update ---------------------------------------------------------------------------
    def local_tensors(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return list(tensors)  # the parameters are this rank's shards already

    def normalising_factor(self, total_sample_size: float, rank_sample_sizes: Sequence[float]) -> float:
        return 1.0 / total_sample_size  # the reduce-scatter sums over the ranks (gloo has no average)

    def clip_grad_norm(self, params: Sequence[nn.Parameter], grads: list[torch.Tensor], owed: float,
                       clip_norm: float) -> tuple[float, float]:
        squares = torch.zeros((), dtype=torch.float64, device=self.context.device)
        if grads:
            squares += torch.stack(torch._foreach_norm(grads)).double().square().sum().to(self.context.device)
        dist.all_reduce(squares)
        gnorm = float(squares.sqrt()) * owed
        if clip_norm > 0:
            return gnorm, owed * min(1.0, clip_norm / (gnorm + 1e-6))
        return gnorm, owed

    # -- checkpoint state ----------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        assert self.engine is not None
        full = self.engine.full_state(self.context.is_master)
        if not self.context.is_master:
            return {}
        return {name: full[id(value)] if id(value) in full else value.detach().cpu()
                for name, value in model.state_dict(keep_vars=True).items()}

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        assert self.engine is not None
        own = model.state_dict(keep_vars=True)
        missing, unexpected = own.keys() - state.keys(), state.keys() - own.keys()
        if missing or unexpected:
            raise KeyError(f"missing keys {sorted(missing)}, unexpected keys {sorted(unexpected)}")
        sliced = {}
        for name, value in own.items():
            param = self.engine.param_of.get(id(value))
            if param is None:
                sliced[name] = state[name]
            elif state[name].shape != param.shape:
                raise RuntimeError(f"size mismatch for {name}: the checkpoint has {tuple(state[name].shape)}, "
                                   f"the model {tuple(param.shape)}")
            else:
                sliced[name] = self._mine(state[name], param.bounds)
        model.load_state_dict(sliced)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                             params: Sequence[nn.Parameter]) -> Optional[dict[str, Any]]:
        assert self.engine is not None
        state = optimizer.state_dict()
        full_state: dict[int, dict[str, Any]] = {}
        for index, shard in enumerate(_in_state_order(optimizer)):
            local = state["state"].get(index)
            if local is None:
                continue
            param = self.engine.param_of[id(shard)]
            full_state[index] = {key: gather_param(param, value, self.context.device)
                                 if _is_sliced(value, shard) else value for key, value in local.items()}
        return {"state": full_state, "param_groups": state["param_groups"]} if self.context.is_master else None

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  params: Sequence[nn.Parameter], state: dict[str, Any]) -> None:
        assert self.engine is not None
        sliced: dict[int, dict[str, Any]] = {}
        ordered = _in_state_order(optimizer)
        for index, values in state["state"].items():
            param = self.engine.param_of[id(ordered[int(index)])]
            sliced[int(index)] = {key: self._mine(value, param.bounds)
                                  if isinstance(value, torch.Tensor) and value.shape == param.shape else value
                                  for key, value in values.items()}
        optimizer.load_state_dict({"state": sliced, "param_groups": state["param_groups"]})

    def _mine(self, full: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        rank = self.context.rank
        return full.reshape(-1)[bounds[rank]:bounds[rank + 1]].clone()

    def shard_report(self, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        """Each rank's ``fraction{r}`` and the bytes of state it holds, ``state_bytes{r}`` (a collective)."""
        held = all_gather_ints(self.context, sum(self.held_state_bytes(optimizer).values()))
        report: dict[str, float] = {}
        for rank, (fraction, size) in enumerate(zip(self.fractions, held)):
            report[f"fraction{rank}"] = fraction
            report[f"state_bytes{rank}"] = size
        return report

def _is_sliced(value: Any, shard: torch.Tensor) -> bool:
    """Whether an optimizer state value is per element (a shard like the parameter's), not a scalar like ``step``."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape == shard.shape


def _in_state_order(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in the order its ``state_dict`` numbers them."""
    return [param for group in optimizer.param_groups for param in group["params"]]

"""``--ddp-backend fully_sharded``: parameters, gradients and optimizer state sharded over the ranks (FSDP2).

Each rank holds a shard of every gradient, so it normalises its shards in place,
the ranks agree on an overflow in one small all-reduce, and the global norm is a
collective. The model and optimizer state are gathered to the master in the plain
format of any other run (:mod:`hetfair.parallel.fsdp2_engine`), so checkpoints move freely.
``--reduce-dtype bf16`` reduce-scatters the gradients in bf16 (gloo reduces bf16 on the
CPU, NCCL on GPUs).
"""

from __future__ import annotations

from contextlib import nullcontext
from types import ModuleType
from typing import TYPE_CHECKING, Any, ContextManager, Optional, Sequence

import torch
from torch import nn

from hetfair.errors import ConfigError
from hetfair.memory.budget import fractions_from_budgets
from hetfair.parallel import cost_model, register_strategy
from hetfair.parallel.config import ParallelConfig
from hetfair.parallel.context import DistributedContext
from hetfair.parallel.sharded_gradients import REDUCE_DTYPES, ShardedGradientsStrategy
from hetfair.parallel.strategy import Strategy

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def _fsdp() -> ModuleType:
    from hetfair.parallel import fsdp2_engine as fsdp  # torch's FSDP and distributed checkpoint: imported only when used

    return fsdp


@register_strategy("fully_sharded")
class FullyShardedStrategy(ShardedGradientsStrategy):
    """torch's ``fully_shard`` on each of the model's sharding units, then on the model itself."""

    @classmethod
    def variant(cls, config: ParallelConfig) -> type[Strategy]:
        """With ``--shard-fractions``, hetfair's uneven engine (FSDP2 shards only evenly); else FSDP2."""
        if config.shard_fractions is None:
            return cls
        from hetfair.parallel.uneven_sharded import UnevenShardedStrategy

        return UnevenShardedStrategy

    @classmethod
    def cost_variants(cls, name: str, job: cost_model.Job) -> list[ParallelConfig]:
        """Equal shards (FSDP2) and, where the devices' memories differ, shards by memory (the uneven engine)."""
        if job.world < 2:
            return []
        memories = [float(rank.memory) for rank in job.ranks]
        by_memory = [ParallelConfig(name, shard_fractions=fractions_from_budgets(memories))] \
            if len(set(memories)) > 1 else []
        return [ParallelConfig(name), *by_memory]

    @classmethod
    def predict(cls, config: ParallelConfig, job: cost_model.Job) -> cost_model.UpdateCost:
        if config.shard_fractions is None:
            return cost_model.fully_sharded(job)
        return cost_model.uneven_sharded(job, config.shard_fractions)

    def __init__(self, config: ParallelConfig, context: DistributedContext) -> None:
        super().__init__(config, context)
        if config.offload:
            raise ConfigError(f"--offload 1 (rank {context.rank}) needs hetfair's uneven engine: give "
                              f"--shard-fractions (equal ones too) or --memory-budget on every rank")
        self._unit_bytes: list[int] = []

    @classmethod
    def builds_deferred(cls, config: ParallelConfig) -> bool:
        return True  # each rank materialises its shards only (fsdp.materialise_shards)

    def shard(self, model: nn.Module, units: Sequence[nn.Module]) -> None:
        self._unit_bytes = unit_bytes(model, units)
        fsdp = _fsdp()
        deferred = fsdp.deferred_tensors(model)  # before fully_shard replaces the parameters
        fsdp.shard_model(model, units, self.config.reshard_after_forward, REDUCE_DTYPES[self.config.reduce_dtype],
                         self.device_mesh())
        if deferred:
            fsdp.materialise_shards(model, deferred)

    def largest_gathered_unit_bytes(self) -> int:
        return max(self._unit_bytes, default=0)

    def device_mesh(self) -> Optional["DeviceMesh"]:
        """The mesh the model is sharded over (``None``: all ranks, one dimension)."""
        return None

    def gradient_sync(self, wrapped: nn.Module, is_last: bool) -> ContextManager[Any]:
        _fsdp().set_gradient_sync(wrapped, is_last)
        return nullcontext()

    def local_tensors(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return _fsdp().local_tensors(tensors)

    def clip_grad_norm(self, params: Sequence[nn.Parameter], grads: list[torch.Tensor], owed: float,
                       clip_norm: float) -> tuple[float, float]:
        # owed is 1: the gradients were normalised in place (holds_full_gradients is False)
        if clip_norm > 0:
            return _fsdp().clip_grad_norm(params, clip_norm), 1.0
        return _fsdp().total_norm(grads), 1.0

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return _fsdp().full_model_state_dict(model)

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        _fsdp().load_full_model_state_dict(model, state)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                             params: Sequence[nn.Parameter]) -> Optional[dict[str, Any]]:
        state = _fsdp().full_optimizer_state_dict(model, optimizer, params)
        return state if self.context.is_master else None

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  params: Sequence[nn.Parameter], state: dict[str, Any]) -> None:
        _fsdp().load_full_optimizer_state_dict(model, optimizer, params, state)


def unit_bytes(model: nn.Module, units: Sequence[nn.Module]) -> list[int]:
    """The full parameter bytes of each unit, then of the rest of the model (the root unit)."""
    seen: set[int] = set()
    sizes = []
    for module in [*units, model]:
        params = [p for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        sizes.append(sum(p.numel() * p.element_size() for p in params))
    return sizes

"""What a model costs whatever the device: FLOPs and saved activations per sample, state sizes, comm hook bytes.

Measured once on the real model and criterion (:func:`measure_model_cost`): torch's
``FlopCounterMode`` counts the FLOPs of a forward and backward, and a
``saved_tensors_hooks`` pair counts the bytes the forward saves for the backward (each storage
once, the parameters left out), each on a batch of one and of two samples, so that what does
not grow with the batch cancels out. A model on the meta device is counted without computing
anything (the same FLOPs and bytes; the criterion's logs read its values as 0). The state sizes
are the automatic plan's (:class:`~hetfair.plan.state.StateSizes`); each comm hook the plan weighs
(:attr:`~hetfair.parallel.comm_hook.CommHook.plan_settings`) says what it sends of these gradients.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from typing import Any, Callable, ContextManager, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from hetfair.parallel.comm_hook import AUTO, hook_options, hooks_in_play
from hetfair.parallel.context import DistributedContext
from hetfair.parallel.cost_model import HookVariant, ModelCost
from hetfair.parallel.pipeline_stage import boundary_bytes
from hetfair.plan.probe import untouched
from hetfair.plan.state import OptimizerFactory, StateSizes
from hetfair.utils import move_to_device


def measure_model_cost(model: nn.Module, criterion: nn.Module, batch_of: Callable[[int], dict[str, Any]],
                       units: Sequence[nn.Module], build_optimizer: OptimizerFactory) -> ModelCost:
    """``model``'s :class:`ModelCost`, from steps on ``batch_of(1)`` and ``batch_of(2)`` (on the model's device, fp32;
    the gradients, buffers and random generators are left as they were)."""
    one, two = _counted_step(model, criterion, batch_of(1)), _counted_step(model, criterion, batch_of(2))
    return replace(state_cost(model, units, build_optimizer), flops_per_sample=max(two[0] - one[0], 1.0),
                   activation_bytes=max(two[1] - one[1], 0),
                   boundary_bytes=boundary_bytes(model, len(units), criterion, batch_of(1)))


def state_cost(model: nn.Module, units: Sequence[nn.Module], build_optimizer: OptimizerFactory) -> ModelCost:
    """``model``'s :class:`ModelCost` without running it: its state and hooks, one FLOP and no activation a sample
    (for a plan that times the model instead, whose rates are then in samples per second)."""
    sizes = StateSizes.of(model, units, build_optimizer)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return ModelCost(parameters=sum(p.numel() for p in trainable), flops_per_sample=1.0, activation_bytes=0,
                     optimizer_ratio=sizes.optimizer_ratio, units=len(units) + 1,
                     largest_unit_bytes=sizes.largest_unit,
                     largest_parameter_bytes=4 * max((p.numel() for p in trainable), default=0),
                     hooks=hook_variants(trainable))


def hook_variants(params: Sequence[nn.Parameter]) -> tuple[HookVariant, ...]:
    """The exact all-reduce and every advised hook at each of its plan settings, with what each sends of the
    gradients of ``params``."""
    context = DistributedContext(0, 1, 0, torch.device("cpu"))
    variants = []
    for name, hook in hooks_in_play(AUTO).items():
        for setting in hook.plan_settings:
            sent = hook(hook_options(hook, setting), context, params).sent_fraction()
            variants.append(HookVariant(name, tuple(setting.items()), sent, hook.lossy))
    return tuple(variants)


def _counted_step(model: nn.Module, criterion: nn.Module, batch: dict[str, Any]) -> tuple[float, int]:
    """The FLOPs of one forward and backward on ``batch``, and the bytes its forward saved for the backward."""
    # storages by identity (the meta device's all have address 0), held so that no id is reused meanwhile
    parameters = {p.untyped_storage() for p in model.parameters()}
    saved: dict[torch.UntypedStorage, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage not in parameters:
            saved[storage] = storage.nbytes()
        return tensor

    counter = FlopCounterMode(display=False)
    device = next(model.parameters()).device
    batch = move_to_device(batch, device)
    try:
        with untouched(model, device), counter, _values_read_as_zero(device):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                loss, _size, _logs = criterion(model, batch)
            loss.backward()
    finally:
        model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops()), sum(saved.values())


def _values_read_as_zero(device: torch.device) -> ContextManager[Any]:
    """On the meta device, a tensor's value read as a number (``float(loss)`` in a criterion's logs) is 0."""
    return _MetaValuesAreZero() if device.type == "meta" else nullcontext()


class _MetaValuesAreZero(TorchDispatchMode):
    """Answers ``aten._local_scalar_dense`` (``item()``, ``float()``) on a meta tensor with 0."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return 0
        return func(*args, **(kwargs or {}))

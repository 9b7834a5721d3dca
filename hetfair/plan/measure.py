"""``hetfair-plan --cluster measure``: this machine's devices as a one-node cluster, each timed on the model.

Each CUDA device (else the CPU) runs :data:`STEPS` forward and backward steps of :data:`SAMPLES` and of
twice as many of the task's largest samples in its precision (``--precision auto``'s rule), each after
one untimed step: the difference is what the extra samples cost, so its rate in that precision is the
model's FLOPs per sample over the seconds per sample (the rate a training step reaches, which the
cluster plan uses as it is), and what a step costs beyond its samples is its step overhead. Its memory
is the device's (a CPU's: ``--memory-budget`` if given, else the machine's). The link between this
machine's devices is the cluster file's default.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from hetfair.cluster.description import DEFAULT_INTRA_NODE, DEFAULT_NETWORK, Cluster, Device, Node
from hetfair.parallel.cost_model import ModelCost
from hetfair.plan.probe import untouched
from hetfair.precision.auto import resolved_precision
from hetfair.precision.mixed import autocast
from hetfair.utils import move_to_device

if TYPE_CHECKING:
    from hetfair.run.wiring import Components

STEPS = 3
SAMPLES = 8


def measure_cluster(components: "Components", batch_of: Callable[[int], dict[str, Any]], cost: ModelCost,
                    memory_budget: int | None) -> Cluster:
    """This machine as a one-node :class:`Cluster`, each device's rate timed on the model."""
    devices = [torch.device("cuda", index) for index in range(torch.cuda.device_count())] or [torch.device("cpu")]
    measured = tuple(_device(components, batch_of, cost, device, memory_budget) for device in devices)
    return Cluster((Node(os.uname().nodename, measured, DEFAULT_INTRA_NODE),), DEFAULT_NETWORK)


def step_costs(model: nn.Module, criterion: nn.Module, batch_of: Callable[[int], dict[str, Any]],
               device: torch.device, precision: str) -> tuple[float, float]:
    """Seconds per sample of a forward and backward of ``model`` on ``device`` in ``precision``, and seconds per
    update beyond them (see the module)."""
    few, more = (step_seconds(model, criterion, batch_of(samples), device, precision)
                 for samples in (SAMPLES, 2 * SAMPLES))
    per_sample = max(more - few, 1e-9) / SAMPLES
    return per_sample, max(0.0, few - SAMPLES * per_sample)


def _device(components: "Components", batch_of: Callable[[int], dict[str, Any]], cost: ModelCost,
            device: torch.device, memory_budget: int | None) -> Device:
    precision = resolved_precision("auto", device)
    per_sample, overhead = step_costs(components.model, components.criterion, batch_of, device, precision)
    rate = cost.flops_per_sample / per_sample
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        return Device(properties.name, int(properties.total_memory), {precision: rate}, None, True, overhead)
    memory = memory_budget or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Device("cpu", int(memory), {"fp32": rate}, None, True, overhead)


def step_seconds(model: nn.Module, criterion: nn.Module, batch: dict[str, Any], device: torch.device,
                  precision: str) -> float:
    """Seconds of one forward and backward of ``batch`` on ``device`` (the mean of :data:`STEPS` after a warm-up)."""
    home = next(model.parameters()).device
    model.to(device)
    batch = move_to_device(batch, device)
    try:
        with untouched(model, device):
            return _mean_step(model, criterion, batch, device, precision)
    finally:
        model.to(home)


def _mean_step(model: nn.Module, criterion: nn.Module, batch: dict[str, Any], device: torch.device,
               precision: str) -> float:
    """The mean seconds of :data:`STEPS` forward and backward steps, after one untimed."""
    for step in range(STEPS + 1):
        if step == 1:
            _synchronize(device)
            started = time.perf_counter()
        with autocast(precision, device):
            loss, _size, _logs = criterion(model, batch)
        loss.backward()
        model.zero_grad(set_to_none=True)
    _synchronize(device)
    return (time.perf_counter() - started) / STEPS


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

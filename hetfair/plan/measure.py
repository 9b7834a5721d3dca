"""``hetfair-plan --cluster measure``: the job's own devices and links, each timed, as a cluster.

The command starts its processes as ``hetfair-train`` does (one per device: ``--distributed-*`` flags,
torchrun or SLURM; alone, one). Each process times the model on its device (:func:`step_costs`:
:data:`STEPS` forward and backward steps of :data:`SAMPLES` and of twice as many of the task's
largest samples, in its precision, each after one untimed step: the difference is what the extra
samples cost, so its rate is the model's FLOPs per sample over the seconds per sample (the rate a
training step reaches, which the cluster plan uses as it is), and what a step costs beyond its
samples is its step overhead). The processes say which node they are on (:mod:`hetfair.parallel.nodes`)
and gather what they measured in one exchange; then one all-reduce of the gradients' size is timed
per link (at least :data:`LINK_PROBE_BYTES`; :mod:`hetfair.plan.predicted`): over every process for the network where there are
several nodes, and inside each node of several processes for its own link. A device's memory is its
own (a CPU's: ``--memory-budget`` if given, else the machine's).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from hetfair.cluster.description import Cluster, Link
from hetfair.parallel.collectives import all_gather_json
from hetfair.parallel.context import DistributedContext
from hetfair.parallel.cost_model import ModelCost
from hetfair.parallel.nodes import node_identity
from hetfair.plan.predicted import measured_cluster, time_link
from hetfair.plan.probe import untouched
from hetfair.precision.mixed import autocast
from hetfair.utils import move_to_device

STEPS = 3
SAMPLES = 8
LINK_PROBE_BYTES = 2**20
"""The least a link is timed with (a small model's gradients would time its latency, not its bandwidth)."""


def measure_cluster(context: DistributedContext, model: nn.Module, criterion: nn.Module,
                    batch_of: Callable[[int], dict[str, Any]], cost: ModelCost, precision: str,
                    memory_budget: Optional[int]) -> Cluster:
    """The job's processes as a :class:`Cluster` of measured devices and links (collectives: every rank calls it)."""
    device = context.device
    per_sample, overhead = step_costs(model, criterion, batch_of, device, precision)
    facts = all_gather_json(context, {
        "node": node_identity(), "host": socket.gethostname(),
        "device": device.type if device.type == "cpu" else torch.cuda.get_device_name(device),
        "memory": memory_budget or device_memory(device), "precision": precision, "seconds_per_sample": per_sample,
        "step_overhead": overhead, "flops_per_sample": cost.flops_per_sample, "batch": SAMPLES})
    nodes = _node_ranks([fact["node"] for fact in facts])
    size = max(cost.parameter_bytes, LINK_PROBE_BYTES)
    network = time_link(context, size) if len(nodes) > 1 else None
    inside = _time_node_links(context, nodes, size)
    return measured_cluster(facts, network, inside)


def _node_ranks(identities: list[str]) -> list[list[int]]:
    """The ranks of each node, in order of their lowest rank."""
    nodes: dict[str, list[int]] = {}
    for rank, identity in enumerate(identities):
        nodes.setdefault(identity, []).append(rank)
    return list(nodes.values())


def _time_node_links(context: DistributedContext, nodes: list[list[int]], size: int) -> list[Optional[Link]]:
    """Each node's own link, timed inside it where it has several processes (every rank creates every node's
    group, as ``new_group`` requires; each times its own); ``None`` for a node of one process."""
    if not context.is_distributed:
        return [None]
    links: list[Optional[Link]] = []
    for ranks in nodes:
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        timed = time_link(context, size, group, len(ranks)) if group is not None and context.rank in ranks else None
        links.append(timed)
    shared = all_gather_json(context, [None if link is None else [link.bandwidth, link.latency] for link in links])
    return [next((Link(*found[index]) for found in shared if found[index] is not None), None)
            for index in range(len(nodes))]


def step_costs(model: nn.Module, criterion: nn.Module, batch_of: Callable[[int], dict[str, Any]],
               device: torch.device, precision: str, few: int = SAMPLES, more: int = 2 * SAMPLES
               ) -> tuple[float, float]:
    """Seconds per sample of a forward and backward of ``model`` on ``device`` in ``precision``, and seconds per
    update beyond them: from timed steps of ``few`` and ``more`` samples (see the module); where they are one
    size, all of it per sample."""
    if few >= more:
        return step_seconds(model, criterion, batch_of(more), device, precision) / more, 0.0
    short, long = (step_seconds(model, criterion, batch_of(samples), device, precision) for samples in (few, more))
    return split_step_costs(short, long, few, more)


def split_step_costs(short: float, long: float, few: int, more: int) -> tuple[float, float]:
    """Seconds per sample and per update from steps of ``few`` and ``more`` samples taking ``short`` and ``long``
    seconds. Where noise (a loaded machine) made the longer step no longer, their difference says nothing: all of the
    longer step counts per sample (a difference clamped near zero would make the device look millions of times
    faster than it is, and a plan split the batch all to it)."""
    if long <= short:
        return long / more, 0.0
    per_sample = (long - short) / (more - few)
    return per_sample, max(0.0, short - few * per_sample)


def step_seconds(model: nn.Module, criterion: nn.Module, batch: dict[str, Any], device: torch.device,
                 precision: str, steps: int = STEPS) -> float:
    """Seconds of one forward and backward of ``batch`` on ``device`` (the mean of ``steps`` after a warm-up)."""
    home = next(model.parameters()).device
    model.to(device)
    batch = move_to_device(batch, device)
    try:
        with untouched(model, device):
            return _mean_step(model, criterion, batch, device, precision, steps)
    finally:
        model.to(home)


def _mean_step(model: nn.Module, criterion: nn.Module, batch: dict[str, Any], device: torch.device,
               precision: str, steps: int) -> float:
    """The mean seconds of ``steps`` forward and backward steps, after one untimed."""
    for step in range(steps + 1):
        if step == 1:
            _synchronize(device)
            started = time.perf_counter()
        with autocast(precision, device):
            loss, _size, _logs = criterion(model, batch)
        loss.backward()
        model.zero_grad(set_to_none=True)
    _synchronize(device)
    return (time.perf_counter() - started) / steps


def device_memory(device: torch.device) -> Optional[int]:
    """The device's memory in bytes (a CPU's: the machine's; ``None`` where the system does not say)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

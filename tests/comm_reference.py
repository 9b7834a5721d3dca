"""The advice's view of a link carrying the built-in comm hooks, for tests that give the numbers themselves."""

from __future__ import annotations

import torch

from hetfair.parallel.comm_advice import HookCost, LinkMeasurement
from hetfair.parallel.comm_hook import COMM_HOOK_REGISTRY
from hetfair.parallel.context import DistributedContext

CPU = DistributedContext(0, 1, 0, torch.device("cpu"))


def builtin_link(gradient_bytes: int, all_reduce_seconds: float, powersgd_bytes: int, nodes: int,
                 world_size: int = 0) -> LinkMeasurement:
    """A measured link and the built-in hooks as the registry declares them (their lossiness, order and, for
    ``none``/``fp16``/``bf16``, their cost), PowerSGD sending ``powersgd_bytes`` (its cost depends on the shapes);
    fp32 gradients of ``world_size`` ranks (one per node where not given)."""
    hooks = []
    for name in ("none", "bf16", "fp16", "powersgd"):
        hook = COMM_HOOK_REGISTRY.get(name)
        sent = powersgd_bytes / gradient_bytes if name == "powersgd" else hook({}, CPU, []).sent_fraction()
        hooks.append((hook.tie_order, HookCost(name, sent, hook.lossy, hook.advised)))
    ordered = sorted(hooks, key=lambda pair: pair[0])
    return LinkMeasurement(gradient_bytes, all_reduce_seconds, nodes, tuple(cost for _, cost in ordered),
                           gradient_bytes // 4, world_size or nodes)

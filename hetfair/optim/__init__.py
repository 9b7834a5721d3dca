"""Optimizer and LR-scheduler registries."""

from hetfair.optim.lr_scheduler.scheduler import LRScheduler
from hetfair.optim.optimizer import HetfairOptimizer
from hetfair.registry import Registry

OPTIMIZER_REGISTRY: Registry[type[HetfairOptimizer]] = Registry(
    "optimizer",
    HetfairOptimizer,
    entry_point_group="hetfair.optimizers",
    builtin_modules=["hetfair.optim.sgd", "hetfair.optim.adam"],
)
LR_SCHEDULER_REGISTRY: Registry[type[LRScheduler]] = Registry(
    "lr_scheduler",
    LRScheduler,
    entry_point_group="hetfair.lr_schedulers",
    builtin_modules=[
        "hetfair.optim.lr_scheduler.fixed",
        "hetfair.optim.lr_scheduler.polynomial_decay",
        "hetfair.optim.lr_scheduler.inverse_sqrt",
        "hetfair.optim.lr_scheduler.cosine",
    ],
)
register_optimizer = OPTIMIZER_REGISTRY.register
register_lr_scheduler = LR_SCHEDULER_REGISTRY.register

__all__ = [
    "HetfairOptimizer",
    "LRScheduler",
    "OPTIMIZER_REGISTRY",
    "LR_SCHEDULER_REGISTRY",
    "register_optimizer",
    "register_lr_scheduler",
]

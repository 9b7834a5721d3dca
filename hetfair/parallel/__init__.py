"""In-training parallelism: one :class:`Strategy` per mode, chosen by ``--ddp-backend NAME`` from a registry."""

from hetfair.parallel.context import DistributedContext
from hetfair.parallel.config import COMM_HOOK_FLAGS, COMM_HOOKS, ZERO_SHARDING_FLAGS, ParallelConfig
from hetfair.parallel.strategy import Strategy
from hetfair.registry import Registry

STRATEGY_REGISTRY: Registry[type[Strategy]] = Registry(
    "strategy",
    Strategy,
    entry_point_group="hetfair.strategies",
    builtin_modules=["hetfair.parallel.replicated", "hetfair.parallel.fully_sharded",
                     "hetfair.parallel.hybrid_sharded", "hetfair.parallel.outer_loop"],
    plural="strategies",
)
register_strategy = STRATEGY_REGISTRY.register


def check_strategy_options(config: ParallelConfig) -> None:
    """The chosen strategy exists and accepts the other flags (at option parsing)."""
    STRATEGY_REGISTRY.get(config.ddp_backend).check_options(config)


def check_strategy_world(config: ParallelConfig, world_size: int) -> None:
    """The chosen strategy can run on ``world_size`` processes (before any process starts); ``auto`` (the plan's
    choice, :mod:`hetfair.plan`) can on any: it replicates a single process."""
    if config.ddp_backend == "auto":
        return
    STRATEGY_REGISTRY.get(config.ddp_backend).check_world(config, world_size)


def build_strategy(config: ParallelConfig, context: DistributedContext) -> Strategy:
    """The strategy ``config.ddp_backend`` names, for this process."""
    return STRATEGY_REGISTRY.get(config.ddp_backend).variant(config)(config, context)


__all__ = ["COMM_HOOK_FLAGS", "COMM_HOOKS", "ZERO_SHARDING_FLAGS", "ParallelConfig", "Strategy", "STRATEGY_REGISTRY",
           "register_strategy", "build_strategy", "check_strategy_options", "check_strategy_world"]

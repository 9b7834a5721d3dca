"""In-training parallelism: one :class:`Strategy` per mode, chosen by ``--ddp-backend NAME`` from a registry, and the
replicated mode's comm hooks (``--ddp-comm-hook NAME``, :mod:`hetfair.parallel.comm_hook`), from another."""

from hetfair.errors import ConfigError, HetfairError
from hetfair.parallel.context import DistributedContext
from hetfair.parallel.comm_hook import COMM_HOOK_REGISTRY, CommHook, register_comm_hook
from hetfair.parallel.config import ZERO_SHARDING_FLAGS, ZERO_SHARDINGS, ParallelConfig
from hetfair.parallel.strategy import PLAN_ROLES, PlanRole, Strategy, refusal_of_backend
from hetfair.registry import Registry

STRATEGY_REGISTRY: Registry[type[Strategy]] = Registry(
    "strategy",
    Strategy,
    entry_point_group="hetfair.strategies",
    builtin_modules=["hetfair.parallel.replicated", "hetfair.parallel.fully_sharded",
                     "hetfair.parallel.hybrid_sharded", "hetfair.parallel.outer_loop", "hetfair.parallel.pipeline"],
    plural="strategies",
    reserved={"auto": "--ddp-backend auto lets the automatic plan choose a strategy"},
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


def plan_candidate(role: PlanRole, registry: Registry[type[Strategy]] = STRATEGY_REGISTRY) -> str:
    """The strategy ``--ddp-backend auto`` chooses as ``role`` (:attr:`Strategy.plan_role`): a built-in one that
    declares it, else the first plugin's by name (only then are plugins imported; one that fails to is skipped)."""
    names = registry.names()
    builtin = [name for name in names if registry.source(name).startswith("built-in")]
    for name in [*builtin, *(name for name in names if name not in builtin)]:
        try:
            if registry.get(name).plan_role == role:
                return name
        except HetfairError:
            continue
    raise ConfigError(f"--ddp-backend auto needs a strategy whose plan_role is '{role}', and none declares it")


def plan_candidates(registry: Registry[type[Strategy]] = STRATEGY_REGISTRY) -> list[str]:
    """Every strategy ``--ddp-backend auto`` may choose, one per role of :data:`PLAN_ROLES`."""
    return [plan_candidate(role, registry) for role in PLAN_ROLES]


def build_strategy(config: ParallelConfig, context: DistributedContext) -> Strategy:
    """The strategy ``config.ddp_backend`` names, for this process."""
    return STRATEGY_REGISTRY.get(config.ddp_backend).variant(config)(config, context)


__all__ = ["COMM_HOOK_REGISTRY", "CommHook", "register_comm_hook", "ZERO_SHARDING_FLAGS", "ZERO_SHARDINGS",
           "ParallelConfig", "PLAN_ROLES", "PlanRole", "Strategy", "STRATEGY_REGISTRY", "register_strategy",
           "build_strategy", "check_strategy_options", "check_strategy_world", "plan_candidate", "plan_candidates",
           "refusal_of_backend"]

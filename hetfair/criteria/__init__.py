"""Criterion registry; built-in criteria live in this package.

hetfair's own ``masked_lm`` comes from the BERT family's spec instead (see :mod:`hetfair.families`).
"""

from hetfair.criteria.criterion import HetfairCriterion, LoggingOutput
from hetfair.registry import Registry

CRITERION_REGISTRY: Registry[type[HetfairCriterion]] = Registry(
    "criterion",
    HetfairCriterion,
    entry_point_group="hetfair.criteria",
    builtin_modules=["hetfair.criteria.cross_entropy"],
    plural="criteria",
)
register_criterion = CRITERION_REGISTRY.register

__all__ = ["HetfairCriterion", "LoggingOutput", "CRITERION_REGISTRY", "register_criterion"]

"""Two strategies as a plugin declares what its mode can do: what live recovery, the plan and the options read.

Not imported by the package's ``__init__``: ``toy_fractions`` owns ``--shard-fractions``, which would change
the one-line error other tests pin for that flag. ``tests/test_strategy_capabilities.py`` imports this module
for one test at a time. Both run as the base class does (single process); only their declarations differ.
"""

from __future__ import annotations

from typing import Optional

from hetfair import register_strategy
from hetfair.parallel import ParallelConfig, Strategy, refusal_of_backend


@register_strategy("toy_whole")
class DeclaresWholeState(Strategy):
    """Every rank holds the whole state: ``--ddp-backend auto``'s replicated part, and live recovery keeps it
    (the base class's answer, not repeated here)."""

    plan_role = "replicated"


@register_strategy("toy_fractions")
class DeclaresFractionShards(Strategy):
    """Each rank holds its ``--shard-fractions`` share of the state: auto's sharded part, budgets fill the
    fractions in, and live recovery refuses it."""

    owned_flags = ("--shard-fractions",)
    takes_shard_fractions = True
    plan_role = "sharded"

    @classmethod
    def live_recovery_refusal(cls, config: ParallelConfig) -> Optional[str]:
        return refusal_of_backend(config, "a lost rank's shard is kept nowhere else")

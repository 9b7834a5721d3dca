"""Memory: sizes as users write them (``6G``), a process's peak memory, budgets turned into shard fractions.

A leaf package (torch and :mod:`hetfair.errors` only), shared by the options, the sharded strategies
and the start-up plan.
"""

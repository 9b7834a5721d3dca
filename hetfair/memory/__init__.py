"""Memory: sizes as users write them (``6G``), a process's peak memory, budgets turned into shard fractions.

Its leaves (:mod:`~hetfair.memory.sizes`, :mod:`~hetfair.memory.peak`, :mod:`~hetfair.memory.budget`: torch
and :mod:`hetfair.errors` only) are shared by the options, the sharded strategies and the start-up plan;
:mod:`~hetfair.memory.plan` (each rank's share of the state, the fit check) and :mod:`~hetfair.memory.table`
(the ``memory |`` table) are parts of a run.
"""

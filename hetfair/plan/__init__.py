"""The automatic per-device plan: ``auto`` micro-batches, precision and ``--ddp-backend``, chosen at start-up.

:mod:`~hetfair.precision.auto` picks a precision from the device, :mod:`~hetfair.plan.state` sizes the
training state a rank holds, :mod:`~hetfair.plan.probe` finds a rank's largest micro-batch by real steps,
and :mod:`~hetfair.plan.planner` puts them together over the ranks into the ``plan |`` table that the
checkpoint keeps (docs/auto-plan.md).
"""

AUTO = "auto"
"""The value of ``--max-sentences``, ``--max-tokens``, ``--precision`` and ``--ddp-backend`` that asks for the plan."""

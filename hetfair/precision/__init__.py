"""Precision: :mod:`~hetfair.precision.mixed` runs each process in its own precision under the job's one
loss scale; :mod:`~hetfair.precision.auto` picks the fastest precision a device trains in (``--precision auto``)."""

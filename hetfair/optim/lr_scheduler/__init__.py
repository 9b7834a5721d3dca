"""Built-in learning-rate schedulers; the registry lives in :mod:`hetfair.optim`."""

"""Starting a job: rendezvous (tcp://, file://, torchrun, SLURM), the launcher and its supervisor, per-process
options, preemption signals. It knows nothing of what the ranks train (see :mod:`hetfair.parallel`)."""

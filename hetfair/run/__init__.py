"""One training run of one process: its typed configuration, its start-up exchange, its state, its loop and validation."""

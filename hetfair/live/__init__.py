"""Live recovery (``--fault-tolerance live``): lost and joining ranks without a restart."""

"""Interval statistics, progress output and TensorBoard scalars."""

"""Checkpoints: :mod:`~hetfair.checkpoint.layout` owns what a checkpoint holds and how it is read;
:mod:`~hetfair.checkpoint.writer` writes it in the background."""

"""Datasets, batch plans and per-rank batch iteration."""

"""The :class:`HetfairModel` base class."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from hetfair.tasks import Task


class HetfairModel(nn.Module):
    """Base of registered models: declare flags in :meth:`add_args`, build in :meth:`build_model`."""

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        """Add this model's hyper-parameter flags to ``parser``."""

    @classmethod
    def build_model(cls, args: argparse.Namespace, task: "Task") -> "HetfairModel":
        raise NotImplementedError

    def sharding_units(self) -> list[nn.Module]:
        """Submodules sharded as units of their own with ``--ddp-backend fully_sharded``.

        Each unit's parameters are gathered just for its forward and backward, so a model
        larger than one device trains when no unit is. The default, ``[]``, makes the whole
        model one unit (still sharded at rest). Return e.g. the transformer layers; modules
        that share a parameter (tied embeddings) must stay in the same unit or in the rest.
        """
        return []

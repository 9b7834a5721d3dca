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

"""The :class:`HetfairOptimizer` base: a named recipe for a ``torch.optim`` optimizer."""

from __future__ import annotations

import argparse
from typing import Any, Iterable

import torch

from hetfair.optim.implementation import implementation_kwargs


class HetfairOptimizer:
    """Says which ``torch.optim`` class to build and with which keyword arguments.

    Keeping the recipe separate from the instance lets the trainer build either
    the plain optimizer or a ZeRO-sharded wrapper around the same class.
    ``--lr`` and ``--weight-decay`` are core flags; subclasses add their own.
    """

    torch_class: type[torch.optim.Optimizer]

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        """Add this optimizer's flags to ``parser``."""

    @classmethod
    def torch_kwargs(cls, args: argparse.Namespace) -> dict[str, Any]:
        """Keyword arguments for :attr:`torch_class`."""
        return {"lr": args.lr, "weight_decay": args.weight_decay}

    @classmethod
    def build_kwargs(cls, args: argparse.Namespace, params: list[torch.nn.Parameter]) -> dict[str, Any]:
        """:meth:`torch_kwargs` plus the implementation ``--optimizer-impl`` chooses for ``params``."""
        return {**cls.torch_kwargs(args), **implementation_kwargs(cls.torch_class, args.optimizer_impl, params)}

    @classmethod
    def build(cls, args: argparse.Namespace, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        params = list(params)
        return cls.torch_class(params, **cls.build_kwargs(args, params))

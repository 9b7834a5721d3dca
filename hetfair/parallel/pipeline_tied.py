"""A weight the first and the last stage of a pipeline share (tied input and output embeddings), kept exact by rows.

The output projection's gradient is dense (every word is scored), the input embedding's is not
(only the rows of the update's tokens). Summing the two copies' whole gradients every update, as
Megatron does, sends the embeddings' size across the link: for a small model with a large
vocabulary, half the gradient the pipeline was chosen to avoid. Here the last stage *owns* the
weight (its optimizer steps it); the first stage *borrows* a copy, a plain tensor outside its
optimizer, and only the rows the update looks up travel, both ways, 2 x rows x width floats:

1. before the update's forward, the owner sends the current rows of the update's tokens, which
   the borrower writes into its copy (its other rows may be stale: nothing reads them);
2. after the backward, the borrower sends its gradient's rows, which the owner adds to its own.

Both ranks know the rows without sending them: every stage of a pipeline loads the same samples,
and the family says which input indexes the embeddings (:meth:`PipelineStage.tied_rows`). A
family that does not say keeps both copies as parameters and sums their whole gradients.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from hetfair.parallel.collectives import comm_device
from hetfair.parallel.context import DistributedContext
from hetfair.parallel.pipeline_stage import PipelineStage


class BorrowedWeight:
    """The first stage's copy of a tied weight: a tensor in place of the parameter in each module holding it."""

    def __init__(self, key: str, holders: list[tuple[nn.Module, str]], tensor: torch.Tensor) -> None:
        self.key = key
        """The weight's name in the whole model's state dict (the first stage's name for it)."""
        self.holders = holders
        self.tensor = tensor

    @classmethod
    def take(cls, key: str, param: nn.Parameter, parts: Sequence[nn.Module]) -> "BorrowedWeight":
        """Replace ``param`` in every module of ``parts`` that holds it by a tensor with its values."""
        holders = [(module, name) for part in parts for module in part.modules()
                   for name, value in module._parameters.items() if value is param]
        borrowed = cls(key, holders, param.detach())
        borrowed.place(param.detach())
        return borrowed

    def place(self, tensor: torch.Tensor) -> None:
        """Make ``tensor`` (a gradient-taking leaf) the copy every holder reads."""
        self.tensor = tensor.requires_grad_()
        for module, name in self.holders:
            module._parameters.pop(name, None)
            setattr(module, name, self.tensor)


class TiedWeights:
    """This rank's part in keeping the pipeline's tied weights equal: owner, borrower, both copies summed
    (``dense``), or nothing (a middle stage)."""

    def __init__(self, context: DistributedContext, peer: Optional[int], group: Any, owned: list[nn.Parameter],
                 borrowed: list[BorrowedWeight], dense: list[nn.Parameter], rows_of: Optional[PipelineStage]) -> None:
        self.context = context
        self.peer = peer
        """The other rank of the pair (the first stage's for the owner, the last stage's for the borrower)."""
        self.group = group
        self.owned = owned
        self.borrowed = borrowed
        self.dense = dense
        self.rows_of = rows_of

    def to(self, device: torch.device) -> None:
        for weight in self.borrowed:
            weight.place(weight.tensor.detach().to(device))

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Take a whole state dict's values into the borrowed copies."""
        for weight in self.borrowed:
            with torch.no_grad():
                weight.tensor.copy_(state[weight.key])

    def refresh(self, inputs: Sequence[dict[str, Any]]) -> None:
        """Before a forward: the borrower's copy gets the owner's current rows of ``inputs``' tokens."""
        if not (self.owned or self.borrowed):
            return
        rows = self._rows(inputs)
        for param in self.owned:
            dist.send(param.detach()[rows].to(comm_device(self.context)), dst=self.peer)
        for weight in self.borrowed:
            received = torch.empty((len(rows), *weight.tensor.shape[1:]), dtype=weight.tensor.dtype,
                                   device=comm_device(self.context))
            dist.recv(received, src=self.peer)
            with torch.no_grad():
                weight.tensor.index_copy_(0, rows.to(weight.tensor.device), received.to(weight.tensor.device))

    def sum_gradients(self, inputs: Sequence[dict[str, Any]]) -> None:
        """After a backward: the owner's gradient gains the borrower's rows (whose own gradient is then cleared);
        with ``dense`` copies, their whole gradients are summed."""
        if self.dense:
            sum_into_grads(self.dense, self.group, self.context)
        if not (self.owned or self.borrowed):
            return
        rows = self._rows(inputs)
        for weight in self.borrowed:
            grad = weight.tensor.grad
            values = grad[rows.to(grad.device)] if grad is not None else \
                torch.zeros((len(rows), *weight.tensor.shape[1:]), dtype=weight.tensor.dtype)
            dist.send(values.contiguous().to(comm_device(self.context)), dst=self.peer)
            weight.tensor.grad = None
        for param in self.owned:
            received = torch.empty((len(rows), *param.shape[1:]), dtype=param.dtype, device=comm_device(self.context))
            dist.recv(received, src=self.peer)
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            param.grad.index_add_(0, rows.to(param.device), received.to(param.device))

    def _rows(self, inputs: Sequence[dict[str, Any]]) -> torch.Tensor:
        assert self.rows_of is not None
        return torch.unique(torch.cat([self.rows_of.tied_rows(item).reshape(-1).cpu() for item in inputs]))


def sum_into_grads(params: Sequence[nn.Parameter], group: Any, context: DistributedContext) -> None:
    """Sum the gradients of ``params`` over ``group`` in one all-reduce (a parameter without one sends zeros)."""
    grads = [param.grad if param.grad is not None else torch.zeros_like(param) for param in params]
    flat = torch.cat([grad.reshape(-1) for grad in grads]).to(comm_device(context))
    dist.all_reduce(flat, group=group)
    offset = 0
    for param, grad in zip(params, grads):
        param.grad = flat[offset:offset + grad.numel()].view_as(grad).to(grad.device)
        offset += grad.numel()

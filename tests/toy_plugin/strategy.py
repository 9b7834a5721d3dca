"""A parallelism strategy as a plugin writes one: replicated without DDP, gradients averaged after the backward."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch.distributed as dist
from torch import nn

from hetfair import register_strategy
from hetfair.parallel import Strategy


@register_strategy("toy_allreduce")
class AllReduceAfterBackward(Strategy):
    """Every rank holds the whole model; the last micro-batch's backward is followed by one all-reduce
    per gradient, averaged over the ranks as DDP's is (the trainer's normalisation expects that)."""

    @contextmanager
    def gradient_sync(self, wrapped: nn.Module, is_last: bool) -> Iterator[None]:
        yield
        if is_last and self.context.is_distributed:
            for param in wrapped.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad)
                    param.grad.div_(self.context.world_size)

"""The stateless built-in comm hooks: ``none`` (DDP's own all-reduce) and torch's ``fp16``/``bf16`` compression.

``fp16``/``bf16`` are :mod:`torch.distributed.algorithms.ddp_comm_hooks.default_hooks`' compress
hooks: each rank's bucket is cast to half precision, summed, divided by the world size and cast
back, so the trainer's ``world_size / total_sample_size`` normalisation holds unchanged.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from hetfair.parallel import CommHook, register_comm_hook


@register_comm_hook("none")
class ExactAllReduce(CommHook):
    """The exact fp32 all-reduce: DDP's own, no hook on it (the default; on gloo the stats ride it through a Python
    hook, :mod:`hetfair.parallel.gradient_comm`)."""

    lossy = False
    advised = False

    def register(self, ddp: DistributedDataParallel, hook: Callable[[Any, dist.GradBucket], Any]) -> None:
        return  # DDP's C++ all-reduce is the exact one, without a Python call per bucket (where no stats ride)


@register_comm_hook("bf16")
class Bf16Compression(CommHook):
    """The gradient in bf16 (``bf16_compress_hook``): half the bytes, fp32's range."""

    tie_order = 0  # at fp16's bytes, it keeps fp32's range

    def communicate(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return default_hooks.bf16_compress_hook(None, bucket)  # type: ignore[arg-type]

    def sent_fraction(self) -> float:
        return 0.5


@register_comm_hook("fp16")
class Fp16Compression(CommHook):
    """The gradient in fp16 (``fp16_compress_hook``): half the bytes."""

    tie_order = 1

    def communicate(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return default_hooks.fp16_compress_hook(None, bucket)  # type: ignore[arg-type]

    def sent_fraction(self) -> float:
        return 0.5

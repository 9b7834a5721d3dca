"""``--optimizer-impl``: which of torch's implementations of an optimizer runs its step.

torch's Adam, AdamW, SGD (and others) have three implementations of the same
update: a per-parameter loop, ``foreach`` (one kernel per operation over all
tensors) and ``fused`` (one kernel for the whole step). On CPU torch picks the
loop unless told otherwise; the fused kernel is 3-6x faster there
(``benchmarks/bench_optimizer_impl.py``) and gives the same update up to
float rounding. ``auto`` therefore asks for ``fused`` where the class has it,
else ``foreach`` where it has that, else leaves torch's choice.
"""

from __future__ import annotations

import inspect
from typing import Any, Iterable

import torch

from hetfair.errors import ConfigError

IMPLEMENTATIONS = ("auto", "fused", "foreach", "for-loop")


def _accepts(torch_class: type[torch.optim.Optimizer], name: str) -> bool:
    return name in inspect.signature(torch_class.__init__).parameters


def _fused_devices() -> list[str]:
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    return _get_fused_kernels_supported_devices()


def _can_fuse(torch_class: type[torch.optim.Optimizer], params: Iterable[torch.Tensor]) -> bool:
    """Whether ``torch_class`` has a fused step for these parameters (plain floating-point tensors on a
    device with fused kernels; FSDP's DTensor shards take ``foreach``)."""
    if not _accepts(torch_class, "fused"):
        return False
    devices = _fused_devices()
    return all(type(p) in (torch.Tensor, torch.nn.Parameter) and p.is_floating_point() and p.device.type in devices
               for p in params)


def implementation_kwargs(torch_class: type[torch.optim.Optimizer], choice: str,
                          params: list[torch.Tensor]) -> dict[str, Any]:
    """The ``fused=`` / ``foreach=`` keyword arguments that select ``choice`` for ``torch_class``."""
    if choice == "auto":
        if _can_fuse(torch_class, params):
            return {"fused": True}
        return {"foreach": True} if _accepts(torch_class, "foreach") else {}
    if choice == "fused":
        if not _can_fuse(torch_class, params):
            raise ConfigError(f"{torch_class.__name__} has no fused implementation for these parameters; "
                              f"use --optimizer-impl auto or foreach")
        return {"fused": True}
    if not _accepts(torch_class, "foreach"):
        raise ConfigError(f"{torch_class.__name__} takes no foreach= argument; use --optimizer-impl auto")
    return {"foreach": choice == "foreach"}

"""How many bytes of training state a rank holds besides what one forward/backward step allocates.

A probe step (:mod:`hetfair.plan.probe`) holds the whole model, its gradients and the step's
activations; training also holds the optimizer's state, and a sharded rank holds only its
fraction of the parameters, gradients and optimizer state plus the largest unit gathered for its
forward and backward. :class:`StateSizes` turns that into the bytes to add to a probe step's peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
from torch import nn

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
_STAND_IN_ELEMENTS = 1024


def parameter_bytes(params: Iterable[nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def optimizer_state_ratio(build_optimizer: OptimizerFactory) -> float:
    """Bytes of optimizer state per byte of parameter, measured by one step of the optimizer on a stand-in
    parameter (1,024 zeros with a zero gradient), never on the model; per-parameter scalars (Adam's step
    count) are left out."""
    stand_in = nn.Parameter(torch.zeros(_STAND_IN_ELEMENTS))
    stand_in.grad = torch.zeros_like(stand_in)
    optimizer = build_optimizer([stand_in])
    optimizer.step()
    state = [value for values in optimizer.state.values() for value in values.values()
             if isinstance(value, torch.Tensor) and value.numel() > 1]
    return sum(t.numel() * t.element_size() for t in state) / parameter_bytes([stand_in])


@dataclass(frozen=True)
class StateSizes:
    """The model's trainable parameter bytes, its largest sharding unit's, and the optimizer's state ratio."""

    params: int
    largest_unit: int
    """Parameter bytes of the largest unit a sharded rank gathers whole (the rest of the model counts as one)."""
    optimizer_ratio: float

    @classmethod
    def of(cls, model: nn.Module, units: Sequence[nn.Module], build_optimizer: OptimizerFactory) -> "StateSizes":
        trainable = [p for p in model.parameters() if p.requires_grad]
        in_units = {id(p) for unit in units for p in unit.parameters()}
        rest = parameter_bytes(p for p in trainable if id(p) not in in_units)
        largest = max([rest] + [parameter_bytes(p for p in unit.parameters() if p.requires_grad) for unit in units])
        return cls(parameter_bytes(trainable), largest, optimizer_state_ratio(build_optimizer))

    @property
    def optimizer(self) -> int:
        return int(self.params * self.optimizer_ratio)

    def replicated(self) -> int:
        """What a whole model's parameters, gradients and optimizer state take."""
        return 2 * self.params + self.optimizer

    def reserve(self, fraction: float | None) -> int:
        """Bytes to add to a probe step's peak for training: the optimizer state when replicated
        (``fraction`` ``None``; DDP keeps gradients in its buckets, no copy); sharded at ``fraction``, its
        share of the optimizer state and the largest unit's gathered parameters and gradients, less the
        parameters and gradients the rank does not hold at rest (a negative reserve: the probe held them)."""
        if fraction is None:
            return self.optimizer
        not_held = (1.0 - fraction) * 2 * self.params
        return int(fraction * self.optimizer + 2 * self.largest_unit - not_held)

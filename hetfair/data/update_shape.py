"""How many samples an update takes, and how they are cut into steps that the ranks can hold.

An update takes ``update_size`` consecutive samples of the epoch's order (the global batch
times ``--update-freq``); each of its steps takes up to ``step_size`` of them, shared among the
ranks. The parameters after an update depend only on its samples (losses are summed and the
gradients divided by the global sample count), so cutting the same update into more, smaller
steps changes nothing but float summation order. That is what lets a run resume on fewer or
smaller ranks: :meth:`UpdateShape.fitted` keeps ``update_size`` and shrinks the steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class UpdateShape:
    """Samples per update over all ranks, and per step (a step is one micro-batch on every rank)."""

    update_size: int
    step_size: int

    @classmethod
    def of(cls, global_batch_size: int, update_freq: int) -> "UpdateShape":
        """The shape of ``--global-batch-size`` samples per step and ``--update-freq`` steps per update."""
        return cls(global_batch_size * update_freq, global_batch_size)

    @property
    def steps_per_update(self) -> int:
        return math.ceil(self.update_size / self.step_size)

    def fitted(self, capacity: int) -> "UpdateShape":
        """The same updates for ranks that hold ``capacity`` samples per step together.

        Unchanged when a step fits; otherwise as few more steps per update as needed, of
        near-equal size (the last step of an update may be a sample smaller).
        """
        if self.step_size <= capacity:
            return self
        steps = math.ceil(self.update_size / capacity)
        return UpdateShape(self.update_size, math.ceil(self.update_size / steps))

    def steps_for(self, samples: int) -> int:
        """Steps that ``samples`` samples from an update boundary take (a last, partial update included)."""
        full, rest = divmod(samples, self.update_size)
        return full * self.steps_per_update + math.ceil(rest / self.step_size)

    def step_bounds(self, step: int) -> tuple[int, int]:
        """Where step ``step`` (counted from an update boundary) starts and ends among those samples."""
        update, within = divmod(step, self.steps_per_update)
        start = within * self.step_size
        return update * self.update_size + start, update * self.update_size + min(start + self.step_size,
                                                                                   self.update_size)

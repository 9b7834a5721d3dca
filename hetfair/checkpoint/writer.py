"""Checkpoint writes on a background thread: a host-memory snapshot is taken at the update boundary,
serialized and renamed into place while training goes on.

At most one write is in flight: a new one first waits for the previous one. A write that failed
raises its error (one line, e.g. a full disk) from the next :meth:`CheckpointWriter.check`, i.e.
the next update boundary, or from the next :meth:`~CheckpointWriter.submit` / :meth:`~CheckpointWriter.wait`.
``torch.distributed.checkpoint.async_save`` does the same for its sharded directory format; hetfair
keeps its one-file ``torch.save`` format, so it only borrows the pattern.
"""

from __future__ import annotations

import copy
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch


def host_snapshot(value: Any) -> Any:
    """A deep copy of ``value`` with every tensor copied to CPU memory, for a write that outlives the step.

    Training mutates parameters and optimizer state in place, so the copy must not share
    storage with them. Tensors that were views of one storage (tied weights) stay one copy.
    """
    return _snapshot(value, {})


def _snapshot(value: Any, memo: dict[tuple, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        key = (value.device, value.data_ptr(), value.dtype, tuple(value.shape), value.stride())
        if key not in memo:
            memo[key] = value.detach().to("cpu", copy=True)
        return memo[key]
    if isinstance(value, dict):
        return {key: _snapshot(item, memo) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_snapshot(item, memo) for item in value]
        return items if isinstance(value, list) else tuple(items)
    return copy.deepcopy(value)


class CheckpointWriter:
    """Runs checkpoint writes one at a time: on a background thread, or here when ``background`` is off."""

    def __init__(self, background: bool) -> None:
        self.background = background
        self._executor: Optional[ThreadPoolExecutor] = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="hetfair-checkpoint") if background else None)
        self._pending: Optional[Future[None]] = None

    def submit(self, write: Callable[[], None]) -> None:
        """Run ``write`` after the previous write is done (raising that one's error, if it failed)."""
        self.wait()
        if self._executor is None:
            write()
        else:
            self._pending = self._executor.submit(write)

    def check(self) -> None:
        """Raise the error of a background write that has failed; never waits."""
        if self._pending is not None and self._pending.done():
            self.wait()

    def wait(self) -> None:
        """Wait for the write in flight; raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for the write in flight (raising its error) and stop the thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)

"""The largest micro-batch a process can train, found by real forward/backward steps.

Each probe step runs the criterion's forward and backward on ``n`` copies of the training set's
longest sample (the largest batch shape the task makes) through the real model, in the process's
precision. A step fits when it raises no out-of-memory error (``torch.cuda.OutOfMemoryError``) and
its peak memory (:mod:`hetfair.memory.peak`: the allocator's on CUDA, the process's resident set on
CPU) plus a reserve for what training holds beyond one step (:mod:`hetfair.plan.state`) stays within
the budget. The search (:class:`BatchSearch`) grows ``n`` from 1, at most doubling it, until a step
does not fit or reaches the upper bound, then narrows the bracket to :data:`SEARCH_PRECISION`; with a
budget each step goes where the line through two measured steps meets it (memory grows about
linearly with the batch), so the search ends a few steps after the first that did not fit; it never
takes more than ``ceil(log2(upper)) + 1 + 2 * ceil(log2(1 / SEARCH_PRECISION))`` steps. Where memory,
not the upper bound, stopped it, the micro-batch keeps a safety margin of :data:`SAFETY_MARGIN` below
the largest step that fitted (allocator fragmentation and the batches' varying shapes in training).

A probe leaves nothing behind: no optimizer step (the parameters are not touched), gradients set to
``None`` after every step, buffers (batch-norm statistics) and the random generators restored, and on
CUDA the allocator's cache emptied after an out-of-memory error and at the end. On CPU, glibc's
``malloc_trim`` hands freed heap back to the system before each step, so that the resident set
measures what the step holds, not what an earlier, larger step left cached.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from hetfair.memory.peak import peak_bytes, reset_peak
from hetfair.precision.mixed import autocast
from hetfair.utils import move_to_device

SEARCH_PRECISION = 0.01
"""The search stops once the largest step that fitted and the smallest that did not are this fraction apart."""
SAFETY_MARGIN = 0.05
"""The micro-batch is this fraction below the largest that fitted (when memory bounded it): room for the
allocator's fragmentation in training, small enough to keep a memory-bound fast rank busy (by its simulated
speeds, a 10% margin makes the steps of the benchmark's 1:1:2:4 cluster, whose fast ranks have the small
memory, 17% longer than the hand-tuned ones; 5%: 2%)."""


@dataclass(frozen=True)
class ProbeResult:
    """What a search found: the largest micro-batch that fitted (0: not even one sample) and what it cost."""

    largest: int
    upper: int
    failed: Optional[int]
    """The smallest micro-batch that did not fit (``None``: all up to ``upper`` did)."""
    steps: int
    seconds: float
    one_sample_bytes: int
    """The peak memory (with the reserve) of a one-sample step: what a rank too small for one sample lacks."""

    @property
    def micro_batch(self) -> int:
        """The micro-batch to train with: the largest that fitted, less the margin where memory bounded it."""
        if self.failed is None or self.largest == 0:
            return self.largest
        return max(1, math.floor(self.largest * (1 - SAFETY_MARGIN)))


def longest_sample_batches(dataset: Dataset, collater: Callable[[list[Any]], dict[str, Any]]
                           ) -> Callable[[int], dict[str, Any]]:
    """``n`` -> a batch of ``n`` copies of the dataset's longest sample (by its ``sizes``, else its first):
    the largest batch of ``n`` samples the task makes."""
    sizes = getattr(dataset, "sizes", None)
    sample = dataset[int(np.argmax(sizes)) if sizes is not None and len(sizes) else 0]
    return lambda samples: collater([sample] * samples)


class MicroBatchProbe:
    """Steps of ``n`` samples of ``batch_of(n)`` through ``model`` and ``criterion`` on ``device``, checked
    against ``budget`` bytes (``None``: only an out-of-memory error stops it)."""

    def __init__(self, model: nn.Module, criterion: nn.Module, batch_of: Callable[[int], dict[str, Any]],
                 device: torch.device, precision: str, budget: Optional[int]) -> None:
        self.model = model
        self.criterion = criterion
        self.batch_of = batch_of
        self.device = device
        self.precision = precision
        self.budget = budget
        self.steps = 0

    def fits(self, samples: int, reserve: int) -> tuple[bool, int]:
        """Whether one training step of ``samples`` fits with ``reserve`` more bytes held; and its peak plus reserve."""
        self.steps += 1
        with untouched(self.model, self.device):
            batch = move_to_device(self.batch_of(samples), self.device)
            _trim_heap(self.device)
            reset_peak(self.device)
            ran = self._step(batch)
            del batch
        peak = peak_bytes(self.device) + reserve
        if not ran:  # only CUDA raises it
            gc.collect()
            torch.cuda.empty_cache()
        return ran and (self.budget is None or peak <= self.budget), peak

    def largest(self, upper: int, reserve: int) -> ProbeResult:
        """The largest micro-batch up to ``upper`` that fits with ``reserve`` (to :data:`SEARCH_PRECISION`)."""
        started, steps_before = time.perf_counter(), self.steps
        fits_one, one_sample = self.fits(1, reserve)
        search = BatchSearch(upper, self.budget, one_sample if fits_one else None)
        while (candidate := search.next_candidate()) is not None:
            search.record(candidate, *self.fits(candidate, reserve))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        _trim_heap(self.device)
        reset_peak(self.device)  # the peak from here on is training's, not the probe's
        return ProbeResult(search.low, upper, search.high, self.steps - steps_before, time.perf_counter() - started,
                           one_sample)

    def _step(self, batch: dict[str, Any]) -> bool:
        """One forward and backward, gradients dropped after; False when the device ran out of memory."""
        try:
            with autocast(self.precision, self.device):
                loss, _sample_size, _logs = self.criterion(self.model, batch)
            loss.backward()
            return True
        except torch.cuda.OutOfMemoryError:
            return False  # the error (and the step's tensors its traceback holds) is freed on leaving
        finally:
            self.model.zero_grad(set_to_none=True)


class BatchSearch:
    """Where to probe next: doubling up from one sample, then narrowing the bracket between the largest step
    that fitted (``low``) and the smallest that did not (``high``) to :data:`SEARCH_PRECISION`.

    Memory grows about linearly with the batch, so with a budget each candidate is where the line through
    two measured steps meets it (the bracket's ends, or the last two steps that fitted): no more than
    doubling the largest that fitted (a step's memory stays below twice what fitted), at least
    :data:`SEARCH_PRECISION` above it. A candidate that did not halve the bracket is followed by a
    bisection, so every two steps at least halve it.
    """

    def __init__(self, upper: int, budget: Optional[int], one_sample_peak: Optional[int]) -> None:
        self.upper = upper
        self.budget = budget
        self.fitted: list[tuple[int, int]] = [(1, one_sample_peak)] if one_sample_peak is not None else []
        """(samples, peak) of the steps that fitted, in order: each larger than the one before."""
        self.failed: Optional[tuple[int, int]] = None if self.fitted else (1, 0)
        """(samples, peak) of the smallest step that did not fit."""
        self.bisect_next = False

    @property
    def low(self) -> int:
        """The largest micro-batch that fitted (0: not even one sample)."""
        return self.fitted[-1][0] if self.fitted else 0

    @property
    def high(self) -> Optional[int]:
        """The smallest micro-batch that did not fit (``None``: none so far)."""
        return self.failed[0] if self.failed else None

    def next_candidate(self) -> Optional[int]:
        """The next micro-batch to try; ``None`` when the search is done."""
        low, high = self.low, self.high
        if low >= self.upper or low == 0:
            return None
        step = max(1, math.ceil(low * SEARCH_PRECISION))
        if high is not None and high - low <= step:
            return None
        if high is not None and self.bisect_next:
            return (low + high) // 2
        predicted = self._where_the_budget_is_met()
        if predicted is None:
            return min(2 * low, self.upper) if high is None else (low + high) // 2
        ceiling = high - 1 if high is not None else min(2 * low, self.upper)
        return int(min(ceiling, max(low + step, math.floor(predicted))))

    def record(self, samples: int, fits: bool, peak: int) -> None:
        """What a step of ``samples`` did: whether it fitted, and its peak memory (with the reserve)."""
        width = None if self.high is None else self.high - self.low
        if fits:
            self.fitted.append((samples, peak))
        else:
            self.failed = (samples, peak)
        halved = width is not None and 2 * (self.high - self.low) <= width
        self.bisect_next = width is not None and not halved and not self.bisect_next

    def _where_the_budget_is_met(self) -> Optional[float]:
        """The batch at which a line through two measured steps reaches the budget (``None``: no such line)."""
        if self.budget is None:
            return None
        if self.failed is not None:
            (n0, p0), (n1, p1) = self.fitted[-1], self.failed
        elif len(self.fitted) >= 2:
            (n0, p0), (n1, p1) = self.fitted[-2], self.fitted[-1]
        else:
            return None
        if p1 <= p0:
            return None  # no growth measured (the resident set grows by pages): nothing to extrapolate
        return n0 + (self.budget - p0) * (n1 - n0) / (p1 - p0)


@contextmanager
def untouched(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Trial steps inside leave the random generators (``device``'s too) and ``model``'s buffers as they were."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), _KeptBuffers(model):
        yield


class _KeptBuffers:
    """Restores the model's buffers (batch-norm running statistics) as they were on entry."""

    def __init__(self, model: nn.Module) -> None:
        self.buffers = list(model.buffers())
        self.saved: list[torch.Tensor] = []

    def __enter__(self) -> None:
        self.saved = [buffer.detach().clone() for buffer in self.buffers]

    def __exit__(self, *_exc: object) -> None:
        with torch.no_grad():
            for buffer, saved in zip(self.buffers, self.saved):
                buffer.copy_(saved)
        self.saved = []


def _trim_heap(device: torch.device) -> None:
    """On CPU with glibc, return freed heap memory to the system (``malloc_trim(0)``); elsewhere nothing."""
    if device.type == "cpu" and _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


_LIBC_NAME = ctypes.util.find_library("c")
_LIBC = ctypes.CDLL(_LIBC_NAME) if _LIBC_NAME else None

"""Preemption: a scheduler's SIGTERM or SIGUSR1 asks a run to save and stop after the current update.

* :func:`preemptible` installs the handlers of a training process: SIGTERM or SIGUSR1 only
  records the request; a second SIGTERM stops at once, as the launcher does: the block ends
  with :class:`~hetfair.errors.Interrupted` and exit code 143 (128 + SIGTERM). A SIGUSR1 before
  a SIGTERM does not count: under torchrun (which signals the whole process group) or SLURM a
  worker gets SIGTERM directly and SIGUSR1 from its launcher, in either order. The request
  is process-wide state because signals are.
* The signal reaches the ranks of a job at different times, but all of them must stop after
  the same update. :class:`StopAgreement` starts a tiny all-reduce (MAX of the request flag)
  at one update boundary and reads it at the next, so it overlaps an update's compute and
  every rank sees the same answer at the same boundary. In training the vote rides on the update's
  stats all-reduce instead (it is a :class:`~hetfair.parallel.stats.Rider`): no collective of its own.
  A single process needs no collective.
* A preempted run exits with :data:`PREEMPTED_EXIT_CODE` (see :class:`hetfair.errors.Preempted`).
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from hetfair.parallel.context import DistributedContext
from hetfair.errors import Interrupted, Preempted

PREEMPTED_EXIT_CODE = Preempted.exit_code
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_requested_by: Optional[int] = None  # the first preemption signal this process received
_sigterm_received = False  # SIGUSR1 never escalates: a launcher forwards it while SIGTERM may come directly
_stopped_by_sigterm = False  # a second SIGTERM asked to stop now


def requested_by() -> Optional[int]:
    """The signal that asked this process to stop (``None``: none yet)."""
    return _requested_by


def request(signum: int) -> None:
    """Record a preemption request, as the signal handler does."""
    global _requested_by
    if _requested_by is None:
        _requested_by = signum


def _on_signal(signum: int, frame: Any) -> None:
    global _sigterm_received, _stopped_by_sigterm
    if signum == signal.SIGTERM:
        if _sigterm_received:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # nothing may interrupt the clean-up
            _stopped_by_sigterm = True
            raise KeyboardInterrupt  # unwinds like Ctrl-C: a save in progress removes its temporary file
        _sigterm_received = True
    request(signum)


@contextmanager
def preemptible() -> Iterator[None]:
    """In the block, SIGTERM / SIGUSR1 request preemption; a second SIGTERM stops at once (main thread only).

    That stop leaves the block as :class:`Interrupted` with exit code 143, the launcher's code for it.
    """
    global _requested_by, _sigterm_received, _stopped_by_sigterm
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _requested_by, _sigterm_received, _stopped_by_sigterm = None, False, False
    previous = {signum: signal.signal(signum, _on_signal) for signum in PREEMPT_SIGNALS}
    try:
        yield
    except (KeyboardInterrupt, Interrupted) as exc:
        if not _stopped_by_sigterm:
            raise
        raise _stopped_by(signal.SIGTERM, exc) from exc
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _stopped_by(signum: int, exc: BaseException) -> Interrupted:
    """The stop at once by ``signum``: a save it cut short keeps its own account."""
    detail = str(exc) if isinstance(exc, Interrupted) else f"interrupted by {signal.Signals(signum).name}"
    stopped = Interrupted(detail)
    stopped.exit_code = 128 + signum
    return stopped


class StopAgreement:
    """Whether every rank stops after this update: a collective, polled once per update on every rank.

    ``regroup_wanted`` (live recovery) rides on the same all-reduce: when it is true on some rank,
    :attr:`regroup` turns true on every rank at the same boundary.

    Where the update's stats all-reduce carried the vote (:meth:`ride`, :meth:`arrive`), the next
    :meth:`poll` decides from it and starts no all-reduce.
    """

    def __init__(self, context: DistributedContext, regroup_wanted: Optional[Callable[[], bool]] = None) -> None:
        self.context = context
        self.regroup_wanted = regroup_wanted
        self.regroup = False
        self._flag: Optional[torch.Tensor] = None
        self._pending: Optional[dist.Work] = None
        self._arrived: Optional[dict[str, float]] = None  # the ranks' votes of the last update, summed

    def ride(self) -> dict[str, float]:
        """This rank's vote, to be summed over ranks: each key counts the ranks that want to stop or regroup."""
        wanted = self.regroup_wanted is not None and self.regroup_wanted()
        return {"stop": float(_requested_by is not None), "regroup": float(wanted)}

    def arrive(self, sums: dict[str, float]) -> None:
        """Every rank's :meth:`ride` summed (the same on every rank): the next :meth:`poll` decides from it."""
        self._arrived = sums

    def poll(self) -> bool:
        """True on every rank at the same update boundary, one or two updates after some rank got a signal
        (after the update whose stats carried the vote, where they did)."""
        if not self.context.is_distributed:
            self.regroup = self.regroup_wanted is not None and self.regroup_wanted()
            return _requested_by is not None
        if self._arrived is not None:
            arrived, self._arrived = self._arrived, None
            self.close()  # an older vote of its own (every rank started it): this one counts the same requests
            self.regroup = arrived["regroup"] > 0
            return arrived["stop"] > 0
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
            assert self._flag is not None
            stop, self.regroup = (bool(value) for value in self._flag.tolist())
            if stop or self.regroup:
                return stop
        wanted = self.regroup_wanted is not None and self.regroup_wanted()
        self._flag = torch.tensor([int(_requested_by is not None), int(wanted)], dtype=torch.int32,
                                  device=self.context.device)
        self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, async_op=True)
        return False

    def close(self) -> None:
        """Finish the all-reduce in flight (every rank started it) before the group is torn down."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

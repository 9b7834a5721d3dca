"""End a command as soon as the reader of its standard output goes away (``cmd | head -1``).

A write to a pipe nobody reads fails only when it is made: a command that computes for a
while between two lines (``hetfair-validate``, one line per split) would go on computing
for nobody until its next line. Instead a daemon thread waits for the pipe's error
condition, which ``poll`` reports to the writer once the last reader has closed it, and
ends the process there, quietly and with the exit status the kernel's SIGPIPE gives.
"""

from __future__ import annotations

import os
import select
import stat
import threading
from contextlib import contextmanager
from typing import Iterator, TextIO

from hetfair_cli.errors import EXIT_BROKEN_PIPE

_GONE = (select.POLLERR | select.POLLHUP) if hasattr(select, "poll") else 0
"""What poll reports on the write end of a pipe whose readers have all closed it (0: no poll here)."""


@contextmanager
def exit_when_reader_leaves(stream: TextIO) -> Iterator[None]:
    """While inside, exit with :data:`EXIT_BROKEN_PIPE` at once when ``stream``, a pipe, loses its reader.

    Outside a pipe (a terminal, a file, a captured stream) or without ``poll`` this does
    nothing, and a closed reader is noticed at the next write, as usual. Leaving the block
    (the last line is written) stops the watch from ending the process.
    """
    fd = _pipe_fd(stream)
    if fd is None or not _GONE:
        yield
        return
    finished = threading.Event()
    threading.Thread(target=_watch, args=(fd, finished), name="stdout-reader-watch", daemon=True).start()
    try:
        yield
    finally:
        finished.set()


def _pipe_fd(stream: TextIO) -> int | None:
    try:
        fd = stream.fileno()
        return fd if stat.S_ISFIFO(os.fstat(fd).st_mode) else None
    except (AttributeError, OSError, ValueError):  # no file behind the stream
        return None


def _watch(fd: int, finished: threading.Event) -> None:
    poller = select.poll()
    poller.register(fd, 0)  # no events asked for: poll still reports POLLERR/POLLHUP, and only those
    events = poller.poll()
    if any(revents & _GONE for _, revents in events) and not finished.is_set():
        os._exit(EXIT_BROKEN_PIPE)  # nothing to save or flush: the lines written so far were flushed each

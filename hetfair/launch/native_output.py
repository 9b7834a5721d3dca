"""Keep torch's C++ log lines of the rendezvous off the terminal, so that a failure there is one line.

While the ranks meet, torch's store logs each retry of a connection as a warning followed by
about 20 lines of C++ stack frames (a port where another program listens and closes or
answers garbage: five retries, ~160 lines), and a warning for every peer address that has
no reverse DNS name ("[W socket.cpp:...] The hostname of the client socket cannot be
retrieved": c10d formats each store connection's peer with ``getnameinfo``, whatever
address or name it was given). ``TORCH_SHOW_CPP_STACKTRACES=0`` does not remove those
frames (torch 2.13); only ``TORCH_CPP_LOG_LEVEL=FATAL`` does, and it is read once when
torch is imported, so it would also silence the C++ errors of training itself (a
collective's watchdog). So only the rendezvous runs with file descriptor 2 on
``/dev/null``; Python's ``sys.stderr`` keeps the terminal, and hetfair reports the
rendezvous's failures as one line of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

CPP_LOG_LEVEL_ENV = "TORCH_CPP_LOG_LEVEL"
"""The user's own choice of torch's C++ log level: whoever sets it wants to see those lines."""


def quiet_native_logs(debug: bool = False) -> bool:
    """Whether torch's C++ log lines are kept off the terminal: unless ``--debug`` or the user's own
    :data:`CPP_LOG_LEVEL_ENV` asks for them."""
    return not debug and CPP_LOG_LEVEL_ENV not in os.environ


@contextmanager
def native_stderr_discarded(enabled: bool = True) -> Iterator[None]:
    """Discard what C and C++ code writes to stderr inside the block (not Python's ``sys.stderr``)."""
    if not enabled:
        yield
        return
    python_stderr = sys.stderr
    python_stderr.flush()
    terminal = os.dup(2)
    sys.stderr = open(terminal, "w", buffering=1, closefd=False)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(terminal, 2)
        sys.stderr.close()
        sys.stderr = python_stderr
        os.close(terminal)


def store_logs_filtered() -> subprocess.Popen:
    """From now on, pass what this process writes to file descriptor 2 through a filter process that drops
    torch's store and socket log records (:mod:`hetfair.launch.store_log_filter`), for the rest of its life.

    For a live rank, whose store is the lighthouse: it meets in a new round whenever a member changes, and
    its heartbeat thread's store calls log ~20 lines of C++ frames when the lighthouse goes away, while
    training runs on the main thread, so no block can discard them as the rendezvous's are. The filter is
    a process of its own, so that a crash's last lines still reach the terminal.
    """
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    script = Path(__file__).with_name("store_log_filter.py")
    child = subprocess.Popen([sys.executable, "-I", str(script)], stdin=read_end, stdout=2,
                             stderr=subprocess.DEVNULL, close_fds=True)
    os.close(read_end)
    os.dup2(write_end, 2)
    os.close(write_end)
    return child

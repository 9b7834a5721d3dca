"""The filter between a live rank and its terminal drops torch's store log records and nothing else, however the
bytes arrive (a record may interrupt a line of Python's, a read may end anywhere)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hetfair.launch.store_log_filter import Filter

RECORD = (b"[rank0]:[W1201 23:20:25.906 TCPStore.cpp:125] [c10d] recvValue failed on SocketImpl(fd=4): Failed to recv\n"
          b"Exception raised from recvBytes at Utils.hpp:787 (most recent call first):\n"
          b"frame #0: c10::Error::Error(c10::SourceLocation) + 0x9d (0x7f in libc10.so)\n"
          b"<omitting python frames>\n"
          b"frame #21: <unknown function> + 0x1098ec (0x7f in libc.so.6)\n\n")
HOSTNAME = b"[W1201 23:07:09.1 socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved\n"
KEPT = (b"train_inner | num_updates 13 | wall 0\n"
        b" 5%|#   | 5/100 [00:01<00:20,  4.50it/s]\r 6%|#   | 6/100 [00:01<00:20,  4.50it/s]\r"
        b"[rank1]: a real error, not the store's\n"
        b"hetfair-train: error: lost the lighthouse ...\n")


def filtered(data: bytes, size: int) -> bytes:
    lines = Filter()
    return b"".join(lines.feed(data[i:i + size]) for i in range(0, len(data), size)) + lines.close()


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 100_000])
def test_records_go_and_everything_else_stays_at_any_read_size(size):
    data = RECORD + KEPT[:38] + HOSTNAME + KEPT[38:] + RECORD
    assert filtered(data, size) == KEPT


@pytest.mark.parametrize("size", [1, 5, 100_000])
def test_a_record_that_interrupts_a_line_leaves_the_line_whole(size):
    # print() writes the text and its newline apart: a heartbeat thread's record came between them
    data = b"train_inner | num_updates 13 | wall 0" + RECORD + b"\ntrain_inner | num_updates 14\n"
    assert filtered(data, size) == b"train_inner | num_updates 13 | wall 0\ntrain_inner | num_updates 14\n"


def test_a_partial_line_goes_out_at_once():
    lines = Filter()
    assert lines.feed(b" 5%|#   | 5/100 [00:01<00:20]\r") == b" 5%|#   | 5/100 [00:01<00:20]\r"
    assert lines.feed(b"wall 0[ran") == b"wall 0"  # what may become a record waits for more


_CHILD = """
import os, sys
from hetfair.launch.native_output import store_logs_filtered
store_logs_filtered()
print("before", file=sys.stderr, flush=True)
os.write(2, %r)
print("after", file=sys.stderr, flush=True)
os.abort()  # a crash: its last lines must still arrive
"""


def test_a_crashing_process_s_last_lines_pass_the_filter():
    done = subprocess.run([sys.executable, "-c", _CHILD % (RECORD + HOSTNAME,)], capture_output=True, timeout=60)
    assert done.returncode < 0 and done.stderr == b"before\nafter\n", done.stderr

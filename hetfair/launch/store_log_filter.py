"""Copy standard input to standard output without c10d's store and socket log records.

Run as a script of its own (``python -I store_log_filter.py``, no package import) by
:func:`hetfair.launch.native_output.store_logs_filtered`, between a live rank's file descriptor 2
and the terminal. A record is a line such as ``[rank0]:[W1201 23:07:09.11 TCPStore.cpp:125] [c10d] ...``
and the ``Exception raised from``/``frame #N``/``<omitting python frames>`` lines and the blank line
after it; every other byte passes unchanged and at once (a progress bar's partial line too). It
ignores SIGINT, SIGTERM and SIGHUP and ends when every writer has closed its end: the rank's last
lines, also those of a crash, still reach the terminal.
"""

from __future__ import annotations

import os
import re
import signal

STORE_RECORD = re.compile(rb"(\[rank\d+\]:)?\[[WEIF]\d{4} [\d:.]+ (TCPStore\w*|socket)\.cpp:\d+\]")
"""The header of a log record of torch's TCPStore or its sockets (it may interrupt a line of Python's)."""
_HEAD = rb"[WEIF](\d{1,4}( ([\d:.]+( ([\w.]+(:\d*)?)?)?)?)?)?"  # any start of "W1201 23:20:25.906 TCPStore.cpp:125"
_RANK = rb"r(a(n(k(\d+(\](:(\[(" + _HEAD + rb")?)?)?)?)?)?)?)?"  # any start of "rank0]:[W1201 ..."
RECORD_START = re.compile(rb"\[(" + _RANK + rb"|" + _HEAD + rb")?$")
"""The end of a partial line that may still grow into a record's header."""
RECORD_DETAIL = (b"Exception raised from ", b"frame #", b"<omitting python frames>")


class Filter:
    """Bytes in, the same bytes out but the store's records; a partial line goes out at once, but for an end
    of it that may start a record."""

    def __init__(self) -> None:
        self.pending = b""  # held back: the start of a line that may be (or is) a record's
        self.in_record = False

    def feed(self, data: bytes) -> bytes:
        *lines, rest = (self.pending + data).split(b"\n")
        return b"".join([*(self._line(line) for line in lines), self._partial(rest)])

    def close(self) -> bytes:
        return b"" if self.in_record else self.pending

    def _line(self, line: bytes) -> bytes:
        if self.in_record:
            if line.startswith(RECORD_DETAIL):
                return b""
            self.in_record = False
            if not line.strip():  # the blank line that ends a record
                return b""
        match = STORE_RECORD.search(line)
        if match:
            self.in_record = True
            return line[: match.start()]  # a line it interrupted goes on after it
        return line + b"\n"

    def _partial(self, rest: bytes) -> bytes:
        if self.in_record:
            self.pending = rest
            return b""
        match = STORE_RECORD.search(rest) or RECORD_START.search(rest)
        cut = match.start() if match else len(rest)
        self.pending = rest[cut:]
        return rest[:cut]


def main() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    lines = Filter()
    while chunk := os.read(0, 65536):
        _write(lines.feed(chunk))
    _write(lines.close())


def _write(data: bytes) -> None:
    while data:
        data = data[os.write(1, data):]


if __name__ == "__main__":
    main()

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

STORE_RECORD = re.compile(rb"^(\[rank\d+\]:)?\[[WEIF]\d{4} [\d:.]+ (TCPStore\w*|socket|Backoff)\.cpp:\d+\]")
"""The first line of a log record of torch's TCPStore or its sockets."""
RECORD_DETAIL = (b"Exception raised from ", b"frame #", b"<omitting python frames>")


class Filter:
    """Lines in, lines out, without the store's records; a partial line goes out at once unless it may start one."""

    def __init__(self) -> None:
        self.pending = b""  # the start of a line that may be a record's first line
        self.in_record = False
        self.at_line_start = True

    def feed(self, data: bytes) -> bytes:
        out = []
        data = self.pending + data
        self.pending = b""
        while data:
            line, newline, data = data.partition(b"\n")
            if not newline:  # a partial line
                if self.at_line_start and (line.startswith(b"[") or self.in_record):
                    self.pending = line
                else:
                    out.append(line)
                    self.at_line_start = False
                break
            if self.at_line_start and self._dropped(line):
                continue
            out.append(line + b"\n")
            self.at_line_start = True
        return b"".join(out)

    def _dropped(self, line: bytes) -> bool:
        if STORE_RECORD.match(line):
            self.in_record = True
            return True
        if self.in_record and (line.startswith(RECORD_DETAIL) or not line.strip()):
            self.in_record = line.strip() != b""  # the blank line ends the record
            return True
        self.in_record = False
        return False

    def close(self) -> bytes:
        return self.pending


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

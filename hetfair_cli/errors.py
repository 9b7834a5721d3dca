"""Turn user mistakes into one error line and exit code 2, and a closed output pipe into a quiet exit."""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import Callable, Sequence

from hetfair.errors import HetfairError, Interrupted, UserDirNeededError

EXIT_BROKEN_PIPE = 141
"""What a shell reports for a process killed by SIGPIPE (128 + 13), as ``cmd | head -1`` ends ``cmd``."""


def run_cli(prog: str, main: Callable[[list[str]], int | None], argv: Sequence[str] | None) -> int:
    """Run ``main(argv)``; a :class:`HetfairError` prints ``prog: error: ...`` and returns its exit code
    (a missing ``--user-dir`` ends with the command to rerun: ``argv`` with that flag added).

    ``--debug`` in ``argv`` or ``HETFAIR_DEBUG=1`` re-raises it with its traceback. When
    the reader of standard output goes away (``prog ... | head -1``), the command
    stops quietly with :data:`EXIT_BROKEN_PIPE`. SIGINT stops the command even when it was
    started with SIGINT ignored (see :func:`_restore_sigint`).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    _restore_sigint()
    try:
        return main(args) or 0
    except HetfairError as exc:
        if "--debug" in args or os.environ.get("HETFAIR_DEBUG") == "1":
            raise
        if isinstance(exc, UserDirNeededError):
            exc = exc.with_rerun(shlex.join([prog, "--user-dir", _as_typed(exc.user_dir), *args]))
        message = str(exc).replace("\n", " ")
        kind = "" if isinstance(exc, Interrupted) else "error: "  # stopping on request is no error
        print(f"{prog}: {kind}{message}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE


def _as_typed(directory: str) -> str:
    """``directory`` relative to the working directory when it lies inside it, as a user would type it."""
    try:
        return str(Path(directory).relative_to(Path.cwd().resolve()))
    except ValueError:
        return directory


def _restore_sigint() -> None:
    """Let SIGINT stop the command again when it came ignored: a shell script starts ``cmd &`` that way,
    and ``kill -INT`` (or the Ctrl-C the script's user presses) would otherwise do nothing."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it at exit raises no second BrokenPipeError."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is no file (captured, replaced): nothing will flush to the pipe
        pass
    finally:
        os.close(devnull)

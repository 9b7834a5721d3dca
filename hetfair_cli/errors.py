"""Turn user mistakes into one error line and exit code 2, and a closed output pipe into a quiet exit."""

from __future__ import annotations

import os
import sys
from typing import Callable, Sequence

from hetfair.errors import HetfairError, Interrupted

EXIT_BROKEN_PIPE = 141
"""What a shell reports for a process killed by SIGPIPE (128 + 13), as ``cmd | head -1`` ends ``cmd``."""


def run_cli(prog: str, main: Callable[[list[str]], int | None], argv: Sequence[str] | None) -> int:
    """Run ``main(argv)``; a :class:`HetfairError` prints ``prog: error: ...`` and returns its exit code.

    ``--debug`` in ``argv`` or ``HETFAIR_DEBUG=1`` re-raises it with its traceback. When
    the reader of standard output goes away (``prog ... | head -1``), the command
    stops quietly with :data:`EXIT_BROKEN_PIPE`.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        return main(args) or 0
    except HetfairError as exc:
        if "--debug" in args or os.environ.get("HETFAIR_DEBUG") == "1":
            raise
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


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it at exit raises no second BrokenPipeError."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is no file (captured, replaced): nothing will flush to the pipe
        pass
    finally:
        os.close(devnull)

"""Turn user mistakes into one error line and exit code 2."""

from __future__ import annotations

import os
import sys
from typing import Callable, Sequence

from hetfair.errors import HetfairError, Interrupted


def run_cli(prog: str, main: Callable[[list[str]], int | None], argv: Sequence[str] | None) -> int:
    """Run ``main(argv)``; a :class:`HetfairError` prints ``prog: error: ...`` and returns its exit code.

    ``--debug`` in ``argv`` or ``HETFAIR_DEBUG=1`` re-raises it with its traceback.
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

"""``hetfair-preprocess``: raw text -> binary splits + vocabulary for the bert task."""

from __future__ import annotations

from typing import Sequence

from hetfair.bert.preprocess import build_parser, preprocess
from hetfair_cli.errors import run_cli


def _main(argv: list[str]) -> int:
    preprocess(build_parser().parse_args(argv))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("hetfair-preprocess", _main, argv)


if __name__ == "__main__":
    raise SystemExit(main())

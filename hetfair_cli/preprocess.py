"""``hetfair-preprocess``: raw text -> binary splits + vocabulary, for the bert task (the default) or
``--task language_modeling``."""

from __future__ import annotations

import argparse
from typing import Any, Callable, Sequence

from hetfair_cli.errors import run_cli

TASKS = ("bert", "language_modeling")


def _add_task_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", choices=TASKS, default="bert",
                        help="the task the data is for; each has its own flags (hetfair-preprocess --task T --help)")


def _family(task: str) -> tuple[argparse.ArgumentParser, Callable[[argparse.Namespace], Any]]:
    """The parser and the preprocess function of ``task``'s family (only the chosen family is imported)."""
    if task == "language_modeling":
        from hetfair.lm.preprocess import build_parser as family_parser, preprocess
    else:
        from hetfair.bert.preprocess import build_parser as family_parser, preprocess
    parser = family_parser()
    _add_task_flag(parser)
    return parser, preprocess


def build_parser(task: str = "bert") -> argparse.ArgumentParser:
    """The parser of ``hetfair-preprocess --task TASK``."""
    return _family(task)[0]


def _main(argv: list[str]) -> int:
    chooser = argparse.ArgumentParser(prog="hetfair-preprocess", add_help=False, allow_abbrev=False)
    _add_task_flag(chooser)
    parser, preprocess = _family(chooser.parse_known_args(argv)[0].task)
    preprocess(parser.parse_args(argv))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("hetfair-preprocess", _main, argv)


if __name__ == "__main__":
    raise SystemExit(main())

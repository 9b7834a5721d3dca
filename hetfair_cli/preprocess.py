"""``hetfair-preprocess``: raw text -> binary splits + vocabulary, for the bert task (the default) or
``--task language_modeling``; any task of a model family whose spec names a preprocessor
(:class:`~hetfair.families.FamilySpec`) is a ``--task`` choice."""

from __future__ import annotations

import argparse
from types import ModuleType
from typing import Any, Callable, Sequence

from hetfair.families import FAMILY_REGISTRY, Family
from hetfair_cli.errors import run_cli

DEFAULT_TASK = "bert"


def preprocessors() -> dict[str, Family]:
    """Each task a family can preprocess -> that family (no preprocessor is imported)."""
    return {task: family for family in FAMILY_REGISTRY.all() if family.spec.preprocessor for task in family.spec.tasks}


def _add_task_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", choices=sorted(preprocessors()), default=DEFAULT_TASK,
                        help="the task the data is for; each has its own flags (hetfair-preprocess --task T --help)")


def _preprocessor(task: str) -> ModuleType:
    """The preprocessor module of ``task``'s family (only the chosen family's is imported)."""
    return preprocessors()[task].preprocessor()


def _family(task: str) -> tuple[argparse.ArgumentParser, Callable[[argparse.Namespace], Any]]:
    """The parser and the preprocess function of ``task``'s family."""
    module = _preprocessor(task)
    parser = module.build_parser()
    _add_task_flag(parser)
    return parser, module.preprocess


def build_parser(task: str = DEFAULT_TASK) -> argparse.ArgumentParser:
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

"""``hetfair-train``: parse options and hand over to the launcher."""

from __future__ import annotations

from typing import Sequence

from hetfair.inventory import describe_plugins
from hetfair.options import parse_train_args
from hetfair_cli.errors import run_cli


def _main(argv: list[str]) -> int:
    args = parse_train_args(argv)
    if args.list_plugins:
        print(describe_plugins())
        return 0
    from hetfair.distributed.launch import launch
    from hetfair.training import check_before_start, train

    check_before_start(args)
    launch(args, train)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("hetfair-train", _main, argv)


if __name__ == "__main__":
    raise SystemExit(main())

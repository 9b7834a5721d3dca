"""``hetfair-train``: parse options and hand over to the launcher."""

from __future__ import annotations

from typing import Sequence

from hetfair.errors import DuplicateComponentError
from hetfair.inventory import clashes, describe_plugins
from hetfair.options import parse_train_args
from hetfair_cli.errors import run_cli


class _TrainCommand:
    """``hetfair-train``'s work; it remembers whether this process started live training, after which the
    process must end without the interpreter's teardown (:func:`hetfair.live.recovery.exit_now`)."""

    def __init__(self) -> None:
        self.live_started = False

    def __call__(self, argv: list[str]) -> int:
        args = parse_train_args(argv)
        if args.list_plugins:
            return _list_plugins()
        from hetfair.launch.launcher import launch
        from hetfair.run.training import check_before_start, train

        check_before_start(args)
        if args.fault_tolerance == "live":
            from hetfair.live.recovery import check_live_options, train_live

            check_live_options(args)
            self.live_started = True
            train_live(args)
            return 0
        launch(args, train)
        return 0


def _list_plugins() -> int:
    """Print every component; names defined twice (training would refuse them) make it fail."""
    print(describe_plugins(), flush=True)
    found = clashes()
    if found:
        raise DuplicateComponentError(f"{len(found)} name{'s are' if len(found) > 1 else ' is'} defined more than "
                                      f"once ({'; '.join(found)}); uninstall or rename one of each")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    command = _TrainCommand()
    code = run_cli("hetfair-train", command, argv)
    if command.live_started:
        from hetfair.live.recovery import exit_now

        exit_now(code)
    return code


if __name__ == "__main__":
    raise SystemExit(main())

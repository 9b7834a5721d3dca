"""Options with one value per local process of a command, e.g. ``--max-sentences 48,16``.

One command may start several processes (``--distributed-gpus N``, or
``--distributed-world-size N`` on one node); under torchrun, each worker is its own
command and the list holds one value per worker of the node (``LOCAL_WORLD_SIZE``),
each taking the item at its ``LOCAL_RANK``. Each option of
:data:`PER_PROCESS_OPTIONS` takes either one value, which every process of the
command uses, or a comma-separated list of exactly one value per process, in the
order of their ranks. :func:`parse_per_process` reads the text (one value stays
a plain value, a list becomes a tuple); the launcher refuses a list of the wrong
length before it starts anything (:func:`check_counts`) and gives each process
the options with its own values (:func:`for_process`).

Under SLURM, where ``srun`` gives every node the same command, values may also be
given per node: ``48:16`` (a :class:`PerNode`) is 48 on the job's first node
(``SLURM_NODEID`` 0) and 16 on its second, and each node's part may itself be a
per-process list (``48,32:16``); :func:`for_node` picks this node's part first.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar, Union

from hetfair.errors import ConfigError
from hetfair.memory.sizes import format_size

T = TypeVar("T")

PER_PROCESS_OPTIONS: tuple[str, ...] = ("max_sentences", "max_tokens", "precision", "device_id",
                                          "memory_budget", "offload", "activation_checkpointing")
"""The ``args`` attributes that may hold one value per local process."""

_SHOWN_AS: dict[str, Callable[[Any], str]] = {"memory_budget": format_size}
"""How an error shows the items of an option whose values are not the text given (sizes become bytes)."""


def flag_of(dest: str) -> str:
    """The command-line flag of an ``args`` attribute: ``max_sentences`` -> ``--max-sentences``."""
    return "--" + dest.replace("_", "-")


@dataclass(frozen=True)
class PerNode:
    """One value (or per-process list) for each node of a SLURM job, in ``SLURM_NODEID`` order."""

    values: tuple[Any, ...]
    text: str

    def __str__(self) -> str:
        return self.text


def parse_per_process(text: str, convert: Callable[[str], T], dest: str) -> Union[T, tuple[T, ...], PerNode]:
    """``"48"`` -> ``48``; ``"48,16"`` -> ``(48, 16)``, each item read by ``convert``; ``"48:16"`` -> a :class:`PerNode`.

    ``convert`` raises :class:`ValueError` with a message for an item it cannot read;
    that becomes a :class:`ConfigError` naming the flag.
    """
    if ":" in text:
        return PerNode(tuple(parse_per_process(part, convert, dest) for part in text.split(":")), text)
    try:
        values = tuple(convert(item.strip()) for item in text.split(","))
    except ValueError as exc:
        raise ConfigError(f"{flag_of(dest)} {text}: {exc}; give one value for every process of this command "
                          f"or one per process, like 'A' or 'A,B'") from None
    return values[0] if len(values) == 1 else values


def values_of(value: Any) -> tuple[Any, ...]:
    """Every value an option holds: the items of a per-process or per-node list, or the one value."""
    if isinstance(value, PerNode):
        return tuple(item for part in value.values for item in values_of(part))
    return value if isinstance(value, tuple) else (value,)


def for_node(args: argparse.Namespace, node: Optional[tuple[int, int]]) -> argparse.Namespace:
    """``args`` with each per-node value (``48:16``) replaced by this node's part.

    ``node`` is ``(this node's index, the number of nodes)``, or ``None`` where nothing says
    which node this is (only SLURM does).
    """
    own = {}
    for dest in PER_PROCESS_OPTIONS:
        value = getattr(args, dest, None)
        if not isinstance(value, PerNode):
            continue
        if node is None:
            raise ConfigError(f"{flag_of(dest)} {value} gives one value per node, which needs SLURM (its "
                              f"SLURM_NODEID says which node this is); give each node's command its own value")
        index, nodes = node
        if len(value.values) != nodes:
            raise ConfigError(f"{flag_of(dest)} {value} gives {len(value.values)} values, one per node, but the "
                              f"SLURM job has {nodes} nodes; give one value per node, separated by ':'")
        own[dest] = value.values[index]
    return argparse.Namespace(**{**vars(args), **own}) if own else args


def check_counts(args: argparse.Namespace, nprocs: int, starter: str = "this command starts") -> None:
    """Refuse a per-process list whose length is not ``nprocs``, the processes ``starter`` starts."""
    for dest in PER_PROCESS_OPTIONS:
        value = getattr(args, dest, None)
        if isinstance(value, tuple) and len(value) != nprocs:
            starts = f"{nprocs} process" + ("es" if nprocs != 1 else "")
            raise ConfigError(
                f"{flag_of(dest)} {','.join(map(_SHOWN_AS.get(dest, str), value))} gives {len(value)} values but "
                f"{starter} {starts}; give one value for all of them or one per process"
            )


def for_process(args: argparse.Namespace, index: int) -> argparse.Namespace:
    """``args`` as local process ``index`` sees them: each per-process list replaced by its own value."""
    own = {dest: value[index] for dest in PER_PROCESS_OPTIONS
           if isinstance(value := getattr(args, dest, None), tuple)}
    return argparse.Namespace(**{**vars(args), **own}) if own else args


class PerProcessValues:
    """The argparse ``type`` of an option that takes one value or one per local process.

    Text becomes a value or a tuple (:func:`parse_per_process`); a default given as a
    value (a task's ``option_defaults``) is checked with :meth:`problem`.
    """

    def __init__(self, convert: Callable[[str], Any], dest: str, kind: type, description: str) -> None:
        self.convert = convert
        self.dest = dest
        self.kind = kind
        self.description = description  # e.g. "an integer"

    def __call__(self, text: str) -> Any:
        return parse_per_process(text, self.convert, self.dest)

    def problem(self, value: Any) -> str | None:
        """Why ``value`` cannot be this option's value (``None`` when it can)."""
        if isinstance(value, str):
            try:
                self(value)
            except ConfigError:
                return f"takes {self.description}"
            return None
        for item in values_of(value):
            if isinstance(item, bool) or not isinstance(item, self.kind):
                name = type(item).__name__
                return f"takes {self.description}, not {'an' if name[0] in 'aeiou' else 'a'} {name}"
        return None

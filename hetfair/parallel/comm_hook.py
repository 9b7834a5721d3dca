"""A ``--ddp-comm-hook NAME``: how the replicated strategy's DDP communicates each bucket of gradients.

One :class:`CommHook` subclass per hook, registered by name (``@hetfair.register_comm_hook``, or the
``hetfair.comm_hooks`` entry-point group), built-in ones included (``none``, ``fp16``, ``bf16``,
``powersgd``). A hook declares its own flags (:meth:`CommHook.add_args`, refused with any other hook),
how it goes on DDP, the checkpoint state it keeps, and its cost for the ``comm |`` advice: the bytes it
sends per update relative to the exact all-reduce's (:mod:`hetfair.parallel.comm_advice`).
``auto`` is no hook: it runs the exact all-reduce until the advice picks one of the hooks that
declare themselves :attr:`CommHook.advised`.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from hetfair.errors import ComponentNotKnownError, HetfairError
from hetfair.parallel.context import DistributedContext
from hetfair.registry import Registry

if TYPE_CHECKING:
    from hetfair.parallel.config import ParallelConfig

AUTO = "auto"
"""``--ddp-comm-hook auto``: measure, then choose one of the advised hooks (no registered hook)."""

EXACT = "none"
"""The exact all-reduce (DDP's own), where ``auto`` starts."""

Options = Mapping[str, Any]
"""A hook's option values by flag (``{"--powersgd-rank": 2}``), each of its flags present."""


class CommHook:
    """One communication hook of one rank's DDP. The defaults are the exact all-reduce, stateless.

    Args:
        options: the value of each of this hook's flags, by flag.
        context: this rank's process context.
        params: the model's parameters, in ``module.parameters()`` order.
    """

    lossy: ClassVar[bool] = True
    """It changes the gradient's numbers (the ``comm |`` line names it lossy)."""
    advised: ClassVar[bool] = True
    """The advice may suggest it and ``auto`` may switch it on."""
    tie_order: ClassVar[int] = 100
    """Among hooks predicted equally fast, the advice picks the lowest (``bf16`` 0 before ``fp16`` 1)."""
    plan_settings: ClassVar[tuple[dict[str, Any], ...]] = ({},)
    """The settings of its flags the cluster plan weighs (by flag; a flag not given at its default)."""
    keeps_state: ClassVar[bool] = False
    """It has checkpoint state (:meth:`state_dict`): the checkpoint's ``comm`` part holds it."""

    def __init__(self, options: Options, context: DistributedContext, params: Sequence[torch.nn.Parameter]) -> None:
        self.options = options
        self.context = context
        self.params = list(params)

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        """Add this hook's own flags; given with another ``--ddp-comm-hook`` (not ``auto``, for an advised
        hook) they are one error line."""

    @classmethod
    def check_options(cls, options: Options) -> None:
        """Refuse option values this hook cannot run with (one :class:`hetfair.errors.ConfigError` line)."""

    def register(self, ddp: DistributedDataParallel, hook: Callable[[Any, dist.GradBucket], Any]) -> None:
        """Put ``hook`` (which calls :meth:`communicate`) on ``ddp``'s gradient all-reduce."""
        ddp.register_comm_hook(None, hook)

    def communicate(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """A ``Future`` of ``bucket``'s buffer reduced to the *mean* over ranks, as DDP's own all-reduce."""
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

    def pass_over(self, bucket: dist.GradBucket) -> None:
        """``auto`` has not switched this hook on yet: ``bucket`` goes by the exact all-reduce."""

    def sent_fraction(self) -> float:
        """Bytes this hook sends per update, relative to the exact fp32 all-reduce's (the advice's cost)."""
        return 1.0

    def fit_link(self, all_reduce_seconds: float, budget_seconds: float) -> Optional[str]:
        """Once the advice knows an update's compute time: fit any ``auto`` setting of this hook to the link, whose
        exact all-reduce takes ``all_reduce_seconds``, so that its own takes at most ``budget_seconds``; the one
        ``comm |`` line that says what it chose (``None``: nothing to choose)."""
        return None

    def discard_update(self) -> None:
        """The update was dropped (an fp16 overflow): forget what it left in the hook's state."""

    def state_dict(self) -> dict[str, Any]:
        """A collective on every rank: plain tensors and numbers for the checkpoint (on the master), keys of
        this hook's own (the ``comm`` part holds every stateful hook's, side by side)."""
        return {}

    def load_state_dict(self, state: dict[str, Any], notice: Callable[[str], None]) -> bool:
        """Continue from the checkpoint's ``comm`` part (``{}``: none) and say so (``True``); where it cannot,
        ``notice`` one line and start afresh (``False``)."""
        return True


COMM_HOOK_REGISTRY: Registry[type[CommHook]] = Registry(
    "comm hook",
    CommHook,
    entry_point_group="hetfair.comm_hooks",
    builtin_modules=["hetfair.parallel.default_comm_hooks", "hetfair.parallel.powersgd"],
    reserved={AUTO: "--ddp-comm-hook auto measures the link, then picks one of the advised hooks"},
)
register_comm_hook = COMM_HOOK_REGISTRY.register


def loadable_hooks() -> dict[str, type[CommHook]]:
    """Every hook that loads, by name: a plugin hook that fails to import is left out here (choosing it says
    why), so that it cannot break a run that does not use it."""
    loaded = {}
    for name in COMM_HOOK_REGISTRY.names():
        try:
            loaded[name] = COMM_HOOK_REGISTRY.get(name)
        except HetfairError:
            continue
    return loaded


def hook_actions(hook: type[CommHook]) -> list[argparse.Action]:
    """The flags ``hook.add_args`` declares, as argparse actions (on a scratch parser)."""
    parser = argparse.ArgumentParser(add_help=False)
    hook.add_args(parser)
    return list(parser._actions)


def hook_flags(hook: type[CommHook]) -> tuple[str, ...]:
    """``hook``'s own flags (each by its first option string)."""
    return tuple(action.option_strings[0] for action in hook_actions(hook))


def hook_options(hook: type[CommHook], given: Options) -> dict[str, Any]:
    """``hook``'s options: the values in ``given`` (by flag), each flag not given at its default."""
    return {action.option_strings[0]: given.get(action.option_strings[0], action.default)
            for action in hook_actions(hook)}


def options_from_args(args: argparse.Namespace) -> tuple[tuple[str, Any], ...]:
    """Every loadable hook's flags with their values in ``args`` (a parsed ``hetfair-train`` command; a flag it
    lacks takes its default where used)."""
    return tuple((action.option_strings[0], getattr(args, action.dest))
                 for hook in loadable_hooks().values() for action in hook_actions(hook) if hasattr(args, action.dest))


def comm_hook_choices() -> list[str]:
    """``--ddp-comm-hook``'s choices: the registered hooks and ``auto`` (no plugin imported)."""
    return [*COMM_HOOK_REGISTRY.names(), AUTO]


def hooks_in_play(requested: str) -> dict[str, type[CommHook]]:
    """The hooks that may communicate in a run of ``--ddp-comm-hook requested``: that one, or under ``auto`` the
    exact one and every advised hook (an unknown name is one error line)."""
    if requested not in comm_hook_choices():
        raise ComponentNotKnownError(f"unknown --ddp-comm-hook '{requested}'; known comm hooks: "
                                     f"{', '.join(comm_hook_choices())}")
    if requested != AUTO:
        return {requested: COMM_HOOK_REGISTRY.get(requested)}
    return {name: hook for name, hook in loadable_hooks().items() if hook.advised or name == EXACT}


def check_comm_hook(config: "ParallelConfig") -> None:
    """``--ddp-comm-hook`` names a hook (or ``auto``), and each hook it may use accepts its options."""
    given = dict(config.comm_options)
    for hook in hooks_in_play(config.ddp_comm_hook).values():
        hook.check_options(hook_options(hook, given))


def comm_hook_flags() -> dict[str, tuple[str, ...]]:
    """The flags each ``--ddp-comm-hook`` value owns: a hook its own, ``auto`` those of every hook it may use."""
    owned = {name: hook_flags(hook) for name, hook in loadable_hooks().items()}
    owned[AUTO] = tuple(dict.fromkeys(flag for hook in hooks_in_play(AUTO).values() for flag in hook_flags(hook)))
    return owned

"""Error types for mistakes a user can fix.

Every error raised for bad input derives from :class:`HetfairError`; the
command-line entry points print its message on one line and exit with code 2
instead of showing a traceback (set ``HETFAIR_DEBUG=1`` or pass ``--debug`` to
see it).
"""

import re


class HetfairError(Exception):
    """Base class of all errors caused by user input or environment."""

    exit_code = 2


class ComponentNotKnownError(HetfairError):
    """A task/model/arch/criterion/optimizer/lr_scheduler name is not registered."""


class DuplicateComponentError(HetfairError):
    """Two definitions claim the same registry name."""


class ComponentTypeError(HetfairError):
    """A registered class does not derive from the registry's base class."""


class PluginLoadError(HetfairError):
    """A plugin (entry point or user dir) failed to import."""


class ConfigError(HetfairError):
    """Inconsistent or invalid options."""


class JobWideError(ConfigError):
    """A mistake every rank finds alike, from what they all exchanged at start-up (the plan, a budget too small):
    the launcher reports it as the job's, without the ``[rank N]`` of the process that happened to report first
    (the message names the ranks it is about)."""


class DataError(HetfairError):
    """Missing, corrupt or unreadable data."""


class CheckpointError(HetfairError):
    """A checkpoint is missing, corrupt or incompatible with the model."""


class UserDirNeededError(CheckpointError):
    """A checkpoint's components come from a ``--user-dir`` that was not given (it is never taken from the checkpoint)."""

    def __init__(self, checkpoint: str, user_dir: str, reason: str, rerun: str = "") -> None:
        fix = f"rerun with it, if you trust that code: {rerun}" if rerun else f"pass --user-dir {user_dir}"
        super().__init__(f"checkpoint {checkpoint} was trained with --user-dir {user_dir}, which is not imported from "
                         f"a checkpoint ({reason}); {fix}")
        self.checkpoint, self.user_dir, self.reason = checkpoint, user_dir, reason

    def with_rerun(self, command: str) -> "UserDirNeededError":
        """The same error, ending with the exact ``command`` to run instead."""
        return UserDirNeededError(self.checkpoint, self.user_dir, self.reason, command)


class DistributedError(HetfairError):
    """Rendezvous failed, ranks disagree, or a rank died or timed out."""


class DivergenceError(HetfairError):
    """Training produced non-finite gradients."""


class Interrupted(HetfairError):
    """The user stopped the run (Ctrl-C or SIGTERM) at a point worth reporting, e.g. during a save."""

    exit_code = 130


class Preempted(Interrupted):
    """A scheduler asked the run to stop (SIGTERM or SIGUSR1): it saved checkpoint_last.pt and stopped.

    Exit code 75 (``EX_TEMPFAIL``: try again later) tells a job script to requeue the job.
    """

    exit_code = 75

    def __init__(self, detail: str, cause: str) -> None:
        super().__init__(f"preempted by {cause}: {detail}")
        self.detail = detail


_ANSI_CODES = re.compile(r"\x1b\[[0-9;]*m")


def first_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message on one line, for one-line errors (its type name when empty).

    That is the message's first line, unless it only introduces details (ends with
    ``:``, as torch's "Error(s) in loading state_dict for Net:"): then the detail
    lines follow it, joined by ``; ``. Terminal colour codes are dropped and the
    line is cut at ``limit`` characters.
    """
    lines = [line.strip() for line in _ANSI_CODES.sub("", str(exc)).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    line = lines[0]
    if line.endswith(":") and len(lines) > 1:
        line = f"{line} {'; '.join(lines[1:])}"
    return line if len(line) <= limit else line[: limit - 3] + "..."

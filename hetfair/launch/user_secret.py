"""A secret that only this user's processes on this machine can read: what signs a loopback job.

A store on a loopback address is reachable by every local user, so its check-in is signed
too. The ranks of such a job may come from several commands (``tcp://127.0.0.1:P`` given to
each, torchrun's workers), all of this user on this machine: they share one random secret
kept in a file of mode 0600 in a directory of mode 0700 in the temporary directory. Another
local user can neither read it nor plant one of their own: a directory or file that is not
this user's alone is refused.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from pathlib import Path
from typing import Callable

from hetfair.errors import ConfigError

SECRET_FILE_NAME = "loopback-secret"


def secret_directory() -> Path:
    """Where this user's loopback secret is kept: ``$TMPDIR/hetfair-UID``."""
    return Path(tempfile.gettempdir()) / f"hetfair-{os.getuid()}"


def user_secret() -> bytes:
    """This user's loopback secret, created on first use (concurrent first uses agree on one)."""
    directory = secret_directory()
    try:
        directory.mkdir(mode=0o700)
    except FileExistsError:
        pass
    _check_private(directory, stat.S_ISDIR)
    path = directory / SECRET_FILE_NAME
    if not path.exists():
        _create(path)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as file:
        _check_private(path, stat.S_ISREG, os.fstat(file.fileno()))
        return file.read().strip()


def _create(path: Path) -> None:
    """Write a fresh secret under a temporary name and link it into place: readers never see a partial file."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".secret-")  # mode 0600
    try:
        with os.fdopen(fd, "w") as file:
            file.write(secrets.token_hex(32))
        try:
            os.link(temporary, path)
        except FileExistsError:
            pass  # another process was first: use its secret
    finally:
        os.unlink(temporary)


def _check_private(path: Path, is_kind: Callable[[int], bool], status: os.stat_result | None = None) -> None:
    status = status or os.lstat(path)
    if not is_kind(status.st_mode) or status.st_uid != os.getuid() or status.st_mode & 0o077:
        raise ConfigError(
            f"{path} holds the secret of this user's loopback jobs but is not private to you (owner uid "
            f"{status.st_uid}, mode {stat.filemode(status.st_mode)}); remove it, or give the job a secret in "
            f"HETFAIR_SECRET"
        )

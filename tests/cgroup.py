"""A memory cgroup a test creates for the processes it starts: the kernel's own memory limit.

cgroup v2 (``memory.max``, where this process's cgroup offers the memory controller to
its children) or v1 (``memory.limit_in_bytes`` under the v1 memory hierarchy). The group
is made inside this process's own cgroup, so it is never looser than the limit already
around the tests, and swap is refused in it, so going over the limit is an OOM kill.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import time
import uuid
from pathlib import Path
from typing import Optional

MOUNTS = Path("/proc/self/mounts")
OWN_CGROUPS = Path("/proc/self/cgroup")


class CgroupUnavailable(RuntimeError):
    """No memory cgroup can be made here; the message says why."""


class MemoryCgroup:
    """One memory cgroup with a limit; :meth:`join` moves the calling process into it, :meth:`remove` deletes it."""

    def __init__(self, path: Path, version: int) -> None:
        self.path = path
        self.version = version

    @classmethod
    def create(cls, limit_bytes: int) -> "MemoryCgroup":
        """A new cgroup limited to ``limit_bytes`` (v2 where it can, else v1); :class:`CgroupUnavailable` if neither."""
        reasons = []
        for version, parent in ((2, _v2_parent()), (1, _v1_parent())):
            if isinstance(parent, str):
                reasons.append(f"cgroup v{version}: {parent}")
                continue
            path = parent / f"hetfair-test-{uuid.uuid4().hex[:8]}"
            try:
                path.mkdir()
            except OSError as exc:
                reasons.append(f"cgroup v{version}: cannot create a group in {parent} ({exc.strerror})")
                continue
            group = cls(path, version)
            try:
                group.set_limit(limit_bytes)
            except OSError as exc:
                group.remove()
                reasons.append(f"cgroup v{version}: cannot set a memory limit in {parent} ({exc.strerror})")
                continue
            return group
        raise CgroupUnavailable("; ".join(reasons))

    def set_limit(self, limit_bytes: int) -> None:
        """Limit the group's memory to ``limit_bytes``, swap included."""
        if self.version == 2:
            (self.path / "memory.max").write_text(str(limit_bytes))
            if (self.path / "memory.swap.max").exists():
                (self.path / "memory.swap.max").write_text("0")
            return
        (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        (self.path / "memory.swappiness").write_text("0")
        if (self.path / "memory.memsw.limit_in_bytes").exists():  # memory + swap: no swap at all
            (self.path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))

    def join(self) -> None:
        """Move the calling process into the group (a ``preexec_fn``: the children it starts stay in it)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def oom_kills(self) -> int:
        """How many processes the kernel killed in this group for going over its limit."""
        events = self.path / ("memory.events" if self.version == 2 else "memory.oom_control")
        match = re.search(r"^oom_kill (\d+)$", events.read_text(), re.MULTILINE)
        return int(match.group(1)) if match else 0

    def peak_usage(self) -> int:
        """The most memory the group's processes have used together since it was made (page cache included)."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        return int((self.path / name).read_text())

    def remove(self, timeout: float = 30.0) -> None:
        """Delete the group, once the processes the test started in it are gone.

        A process whose parent has ended it can still be listed while the kernel finishes its exit,
        and ``rmdir`` refuses a group that is busy (EBUSY) until then: whatever is still listed is
        killed (only the test's own processes run here) and the removal waits for the kernel, up to
        ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            for pid in (self.path / "cgroup.procs").read_text().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self.path.rmdir()
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
            time.sleep(0.1)


def _v2_parent() -> Path | str:
    mount = _mount_point("cgroup2")
    own = _own_group(lambda controllers: controllers == "")
    if mount is None or own is None:
        return "not mounted"
    parent = mount / own.lstrip("/")
    if "memory" not in (parent / "cgroup.subtree_control").read_text().split():
        return f"{parent} does not offer the memory controller to its groups"
    return parent


def _v1_parent() -> Path | str:
    mount = _mount_point("cgroup", option="memory")
    own = _own_group(lambda controllers: "memory" in controllers.split(","))
    if mount is None or own is None:
        return "no memory hierarchy mounted"
    return mount / own.lstrip("/")


def _mount_point(fs_type: str, option: Optional[str] = None) -> Optional[Path]:
    for line in MOUNTS.read_text().splitlines():
        _device, point, kind, options, *_ = line.split()
        if kind == fs_type and (option is None or option in options.split(",")):
            return Path(point)
    return None


def _own_group(matches) -> Optional[str]:
    """This process's group in the hierarchy whose controller list ``matches`` (``/proc/self/cgroup``)."""
    for line in OWN_CGROUPS.read_text().splitlines():
        _number, controllers, path = line.split(":", 2)
        if matches(controllers):
            return path
    return None

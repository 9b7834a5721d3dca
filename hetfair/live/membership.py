"""Membership rounds of ``--fault-tolerance live``: who trains together, agreed through the lighthouse's store.

Built on torch's own primitives (a :class:`torch.distributed.TCPStore` on the lighthouse, a fresh gloo or
NCCL group per round under its own key prefix) rather than torchft: hetfair's strategies, statistics and
checkpoint parts all run on torch's default process group, which a new group per round keeps as it is
(see docs/elastic.md, "Live recovery", for the measurement behind the choice).

A round ``n`` is a set of keys under ``r{n}/``. Each process that wants to train (at start, after a lost
peer, or to let a waiting process in) arrives there with its training progress; the first arrival whose
heartbeat is alive closes the round when every member of round ``n - 1`` has arrived or stopped
heartbeating (dropped), or, in the job's first round, when ``--distributed-world-size`` processes came.
Closing is one ``compare_set``, so exactly one decision stands. Survivors keep their order, joiners
follow in order of arrival. Every process beats a counter on the lighthouse from a thread of its own
(:class:`Heartbeat`), which also watches for an arrival in the next round: a process waiting to join.

Every key lies under the job's secret prefix and every record read is checked against the job's secret
(:mod:`hetfair.live.records`): an arrival, decision, round number or end that is not signed is not there.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

import torch.distributed as dist

from hetfair.errors import DistributedError, HetfairError, first_line
from hetfair.live.records import JobRecords

HEARTBEAT_SECONDS = 0.25
"""How often a process beats its counter on the lighthouse."""
STALE_SECONDS = 2.0
"""A member whose counter has not moved for this long (or ``--live-timeout``, if shorter) is dropped from a round."""
_POLL_SECONDS = 0.02  # how often a waiting process reads the round's keys
RoundProgress = tuple[int, int, int]
"""A member's training progress: (epoch, samples done in it, updates); the largest holds the newest state."""


def say(line: str) -> None:
    """A ``live |`` line on this process's stderr (every rank's: membership changes are rare and worth seeing)."""
    print(f"live | {line}", file=sys.stderr, flush=True)


class JobEnded(HetfairError):
    """The job ended while this process waited to join it, or without it (it had been dropped): exit code 3, which a
    requeue script must not take for success (0) nor for a preemption (75)."""

    exit_code = 3


@dataclass(frozen=True)
class Member:
    uid: str
    progress: Optional[RoundProgress]
    """``None``: a process without training state (a new one)."""


@dataclass(frozen=True)
class Group:
    """A closed round: its members in rank order, and how many the round before had."""

    round: int
    members: tuple[Member, ...]
    rank: int
    previous_size: int
    """Members of the round before (0: this is the job's first)."""
    survivors: int
    """Members of the round before that are in this one."""

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def majority_lost(self) -> bool:
        """Fewer than half of the previous round's members came back (a majority is lost): the job ends, with a
        checkpoint. One lighthouse decides every round, so half of them going on cannot split the job in two."""
        return 2 * self.survivors < self.previous_size

    def donor(self) -> Optional[int]:
        """The rank whose state is the newest (lowest rank among equals); ``None`` when no member has any."""
        holders = [(m.progress, -rank) for rank, m in enumerate(self.members) if m.progress is not None]
        return -max(holders)[1] if holders else None

    def receivers(self) -> list[int]:
        """The ranks whose own state is not the donor's: joiners, and survivors one update behind."""
        donor = self.donor()
        if donor is None:
            return []
        newest = self.members[donor].progress
        return [rank for rank, m in enumerate(self.members) if m.progress != newest]


class Heartbeat:
    """A thread that beats this process's counter and notices a process waiting in the next round."""

    def __init__(self, records: JobRecords, uid: str) -> None:
        self.records = records
        self.uid = uid
        self.current_round = 0
        self.join_waiting = False
        self.lost: Optional[str] = None
        """Why the lighthouse stopped answering (``None``: it answers)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="hetfair-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self.records.add(f"hb/{self.uid}", 1)
                self.join_waiting = self.records.store.check([f"r{self.current_round + 1}/arrived"])
            except (RuntimeError, dist.DistError) as exc:
                self.lost = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                return
            self._stop.wait(HEARTBEAT_SECONDS)

    def close(self) -> None:
        """Stop beating; a beat stuck on a lighthouse that stopped answering is not waited for (the thread is a
        daemon, and a live process ends without the interpreter's teardown)."""
        self._stop.set()
        self._thread.join(timeout=4 * HEARTBEAT_SECONDS)


class Membership:
    """This process's part in the rounds: arrive, wait for the decision, and know when to arrive again."""

    def __init__(self, connect: Callable[[], JobRecords], initial_world_size: int, timeout: float,
                 live_timeout: float) -> None:
        """``connect``: a new client of the lighthouse (one for the rounds, one for the heartbeat thread)."""
        self.records = connect()
        self.uid = uuid.uuid4().hex
        self.initial_world_size = initial_world_size
        self.timeout = timeout
        self.live_timeout = live_timeout
        self.stale_seconds = min(STALE_SECONDS, live_timeout)
        self.group: Optional[Group] = None
        self.heartbeat = Heartbeat(connect(), self.uid)
        self._seen: dict[str, tuple[int, float]] = {}  # uid -> (counter, when it last moved)

    # -- what the training loop asks between updates ------------------------------------------
    def regroup_wanted(self) -> bool:
        """A process waits in the next round (to join, or a member that lost contact), or the lighthouse is lost."""
        return self.heartbeat.join_waiting or self.heartbeat.lost is not None

    def lighthouse_lost(self) -> Optional[str]:
        return self.heartbeat.lost

    @property
    def store(self) -> dist.Store:
        """The job's keys (under its secret prefix), where each round's process group meets."""
        return self.records.store

    def finish(self) -> None:
        """Tell processes waiting to join that the job is over."""
        self.records.set("finished", "1")

    def close(self) -> None:
        self.heartbeat.close()

    # -- rounds -------------------------------------------------------------------------------
    def next_group(self, progress: Optional[RoundProgress]) -> Group:
        """Arrive in the next round with ``progress`` and return its group once closed (this process in it)."""
        try:
            return self._next_group(progress)
        except (RuntimeError, dist.DistError) as exc:
            raise DistributedError(f"lost the lighthouse while agreeing on the members ({first_line(exc)}); start a "
                                   f"new lighthouse and the same commands to resume from the last checkpoint") from exc

    def _next_group(self, progress: Optional[RoundProgress]) -> Group:
        latest = int(self.records.get("latest") or 0)
        number = max(latest, self.group.round if self.group else 0) + 1
        self._arrive(number, progress)
        deadline = time.monotonic() + self.timeout + self.live_timeout  # a member may be stuck in a collective
        while True:
            decision = self._decision(number)
            if decision is not None:
                uids = [member.uid for member in decision]
                if self.uid in uids:
                    return self._joined(number, decision)
                number += 1  # closed without this process (its heartbeat looked dead): the next one
                self._arrive(number, progress)
                continue
            if self.records.get("finished") is not None:
                raise self._ended()
            self._close_if_due(number)
            if time.monotonic() > deadline:
                raise DistributedError(f"membership round {number} did not close within --distributed-timeout "
                                       f"{self.timeout:g}s (+ --live-timeout); check that every process reaches "
                                       f"the lighthouse")
            time.sleep(_POLL_SECONDS)

    def _ended(self) -> JobEnded:
        if self.group is None:
            return JobEnded("the job at this lighthouse has ended; start a new lighthouse for a new run")
        return JobEnded(f"the job at this lighthouse ended without this process: it was dropped after round "
                        f"{self.group.round} (no answer for --live-timeout {self.live_timeout:g}s), and the others "
                        f"finished and saved the run; start a new lighthouse for a new run")

    def _arrive(self, number: int, progress: Optional[RoundProgress]) -> None:
        self.records.set(f"r{number}/info/{self.uid}", json.dumps({"progress": progress}))
        index = self.records.add(f"r{number}/arrived", 1)
        self.records.set(f"r{number}/uid/{index}", self.uid)
        say(f"waiting in round {number} (arrival {index})")

    def _joined(self, number: int, members: list[Member]) -> Group:
        previous = {member.uid for member in self._decision(number - 1) or []}
        uids = [member.uid for member in members]
        self.group = Group(number, tuple(members), uids.index(self.uid), len(previous), len(previous & set(uids)))
        self.heartbeat.current_round = number
        self.heartbeat.join_waiting = False
        return self.group

    def _decision(self, number: int) -> Optional[list[Member]]:
        decision = self.records.get(f"r{number}/closed") if number >= 1 else None
        if decision is None:
            return None
        return [Member(uid, tuple(progress) if progress is not None else None)  # type: ignore[arg-type]
                for uid, progress in json.loads(decision)]

    def _arrivals(self, number: int) -> Optional[list[Member]]:
        """The round's arrivals in order; ``None`` while one of them is still writing its records."""
        count = self.records.add(f"r{number}/arrived", 0)
        arrivals = []
        for index in range(1, count + 1):
            uid = self.records.get(f"r{number}/uid/{index}")
            info = self.records.get(f"r{number}/info/{uid}") if uid is not None else None
            if info is None:
                return None
            progress = json.loads(info)["progress"]
            arrivals.append(Member(uid, tuple(progress) if progress is not None else None))  # type: ignore[arg-type]
        return arrivals

    def _alive(self, uid: str) -> bool:
        """Whether ``uid``'s heartbeat counter moved within the stale time (as seen from here)."""
        counter, now = self.records.add(f"hb/{uid}", 0), time.monotonic()
        seen = self._seen.get(uid)
        if seen is None or seen[0] != counter:
            self._seen[uid] = (counter, now)
            return True
        return now - seen[1] < self.stale_seconds

    def _close_if_due(self, number: int) -> None:
        """Where this process is the first live arrival: close the round once nobody live is missing."""
        arrivals = self._arrivals(number)
        if not arrivals:
            return
        first_alive = next((m for m in arrivals if m.uid == self.uid or self._alive(m.uid)), None)
        if first_alive is None or first_alive.uid != self.uid:
            return
        previous = self._decision(number - 1)
        arrivals = [m for m in arrivals if m.uid == self.uid or self._alive(m.uid)]  # not one that died since
        arrived = {member.uid: member for member in arrivals}
        if previous is None:
            if len(arrivals) < self.initial_world_size:
                return
            members = arrivals
        else:
            if any(m.uid not in arrived and self._alive(m.uid) for m in previous):
                return  # a member still trains or is on its way
            survivors = [arrived[m.uid] for m in previous if m.uid in arrived]
            kept = {m.uid for m in previous}
            members = survivors + [m for m in arrivals if m.uid not in kept]
        self.records.decide(f"r{number}/closed", json.dumps([[m.uid, m.progress] for m in members]))
        self.records.set("latest", str(number))

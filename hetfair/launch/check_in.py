"""The ranks' check-in, before the process group is built, with signed values.

Every rank checks in through the store: a rank whose ``--distributed-world-size`` differs
from rank 0's aborts the whole group with a message naming both values, and ranks that
never arrive are reported after ``--distributed-timeout`` instead of waiting forever.

Rank 0 publishes the world size with a fresh per-job nonce; every rank publishes its
arrival; a rank that finds a mismatch publishes an abort message. With a secret (see
:mod:`hetfair.launch.rendezvous`) each value carries an HMAC-SHA256 over its key, the
value and the nonce, and ranks act only on values whose signature verifies.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from typing import Optional

import torch.distributed as dist

from hetfair.launch.rendezvous import SECRET_ENV
from hetfair.errors import DistributedError, first_line

_WORLD_SIZE_KEY = "hetfair/world_size"
_ARRIVED_KEY = "hetfair/arrived/"
_ABORT_KEY = "hetfair/abort"
_POLL_SECONDS = 0.05
_HOST_GRACE_SECONDS = 3.0


class Signer:
    """HMAC-SHA256 signatures of store values (or none, for a private store without a secret)."""

    def __init__(self, secret: Optional[bytes]) -> None:
        self.secret = secret

    def sign(self, key: str, value: str) -> str:
        """``value`` with its signature (unchanged without a secret)."""
        if self.secret is None:
            return value
        return f"{self._mac(key, value)}:{value}"

    def verify(self, key: str, stored: bytes) -> Optional[str]:
        """The value if its signature is valid, else ``None``."""
        text = stored.decode("utf-8", errors="replace")
        if self.secret is None:
            return text
        mac, sep, value = text.partition(":")
        return value if sep and hmac.compare_digest(mac, self._mac(key, value)) else None

    def _mac(self, key: str, value: str) -> str:
        assert self.secret is not None
        return hmac.new(self.secret, f"{key}\0{value}".encode(), hashlib.sha256).hexdigest()


class CheckIn:
    """One rank's check-in (:meth:`wait`): rank 0 publishes the world size and a nonce; everyone signs its
    arrival; all ``world_size`` ranks must arrive and agree on the world size."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout: float,
                 secret: Optional[bytes]) -> None:
        self.store, self.rank, self.world_size, self.timeout = store, rank, world_size, timeout
        self.signer = Signer(secret)
        # rank 0 hosts the store: it gives up last, so the others can still tell their own story
        self.deadline = time.monotonic() + timeout + (_HOST_GRACE_SECONDS if rank == 0 else 0.0)
        self.nonce = ""
        self.saw_unsigned = False

    def wait(self) -> None:
        """Check in; one error line when a rank differs, stays away past the timeout, or the store is lost."""
        try:
            self._run()
        except (RuntimeError, OSError) as exc:  # the store's host (rank 0) went away
            raise DistributedError(
                f"rank {self.rank} lost the rendezvous store during the check-in ({first_line(exc)}); rank 0 "
                f"stopped, see its message"
            ) from exc

    def stalled(self) -> str:
        """Why a check-in that a store call kept from ending on time failed: what it had seen of the secret."""
        return (f"rank {self.rank} did not finish the check-in within {self.timeout:.0f}s: a call to the store did "
                f"not return; check --distributed-init-method{self._secret_hint()}")

    def _run(self) -> None:
        if self.rank == 0:
            self.nonce = secrets.token_hex(8)
            self.store.set(_WORLD_SIZE_KEY, self.signer.sign(_WORLD_SIZE_KEY, f"{self.world_size}|{self.nonce}"))
        else:
            self._read_rank0_world_size()
        key = f"{_ARRIVED_KEY}{self.rank}"
        self.store.set(key, self.signer.sign(key, self.nonce))
        keys = [f"{_ARRIVED_KEY}{r}" for r in range(self.world_size)]
        while not (self.store.check(keys) and self._arrived(keys) == self.world_size):
            self._check_abort()
            if time.monotonic() > self.deadline:
                raise DistributedError(
                    f"only {self._arrived(keys)} of {self.world_size} processes joined within {self.timeout:.0f}s; "
                    f"start every node's command with the same --distributed-init-method, or raise "
                    f"--distributed-timeout{self._secret_hint()}"
                )
            time.sleep(_POLL_SECONDS)

    def _read_rank0_world_size(self) -> None:
        while True:
            if self.store.check([_WORLD_SIZE_KEY]):
                value = self.signer.verify(_WORLD_SIZE_KEY, self.store.get(_WORLD_SIZE_KEY))
                if value is not None:
                    break
                if not self.saw_unsigned:  # let rank 0 see a check-in it cannot verify: it points at the secret
                    key = f"{_ARRIVED_KEY}{self.rank}"
                    self.store.set(key, self.signer.sign(key, "unverified"))
                self.saw_unsigned = True
            if time.monotonic() > self.deadline:
                raise DistributedError(
                    f"rank 0 did not check in within {self.timeout:.0f}s; start rank 0's command "
                    f"or check --distributed-init-method{self._secret_hint()}"
                )
            time.sleep(_POLL_SECONDS)
        expected, _, self.nonce = value.partition("|")
        if expected != str(self.world_size):
            message = (
                f"rank {self.rank} was started with --distributed-world-size {self.world_size} but rank 0 with "
                f"{expected}; give every node's command the same --distributed-world-size"
            )
            self.store.set(_ABORT_KEY, self.signer.sign(f"{_ABORT_KEY}|{self.nonce}", message))
            raise DistributedError(message)

    def _arrived(self, keys: list[str]) -> int:
        count = 0
        for key in keys:
            if self.store.check([key]):
                if self.signer.verify(key, self.store.get(key)) == self.nonce:
                    count += 1
                else:
                    self.saw_unsigned = True
        return count

    def _check_abort(self) -> None:
        if not self.store.check([_ABORT_KEY]):
            return
        message = self.signer.verify(f"{_ABORT_KEY}|{self.nonce}", self.store.get(_ABORT_KEY))
        if message is None:
            self.saw_unsigned = True  # not from this job: ignored
            return
        raise DistributedError(message)

    def _secret_hint(self) -> str:
        if not self.saw_unsigned:
            return ""
        return (f" (the store holds check-in values not signed with this node's secret: give every node the same "
                f"{SECRET_ENV})")

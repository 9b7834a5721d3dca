"""The live job's records on the lighthouse: keys only the job's secret names, values only it signs.

torch's :class:`~torch.distributed.TCPStore` has no authentication, so whoever reaches the lighthouse can
read, write and delete keys. A live job therefore keeps every key (membership rounds, heartbeats, and each
round's process group, gloo's addresses included) under a prefix derived from the job's secret
(``HETFAIR_SECRET`` / ``--distributed-secret``, or this user's loopback secret): a store offers no way to
list keys, so a stranger cannot find them. And every membership record a rank acts on (an arrival, a
round's decision, the newest round, the job's end) carries an HMAC-SHA256 over its key and value, as the
tcp:// check-in does (:class:`~hetfair.launch.check_in.Signer`): a record that does not verify is treated
as absent. Counters (arrivals, heartbeats) cannot be signed; they are found only under the secret prefix.

One key is public, :data:`JOB_KEY`: a proof that the job's first process knew its secret, so that a
process with another secret (a stranger, or a typo) ends with one line instead of waiting in a namespace
of its own for a job that never forms.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Optional

import torch.distributed as dist

from hetfair.errors import ConfigError
from hetfair.launch.check_in import Signer
from hetfair.launch.rendezvous import SECRET_ENV

JOB_KEY = "hetfair/live/job"
"""The one public key: this job's proof of its secret."""
_PROOF = "a hetfair live job"


class JobRecords:
    """A live job's view of the lighthouse's store: its secret prefix, signed values."""

    def __init__(self, store: dist.Store, secret: bytes) -> None:
        namespace = hmac.new(secret, b"hetfair live namespace", hashlib.sha256).hexdigest()[:32]
        self.public = store
        self.store = dist.PrefixStore(f"hetfair/live/{namespace}", store)
        """The job's keys, unsigned: counters, and the process groups' own rendezvous under ``r{n}/pg``."""
        self.signer = Signer(secret)

    def claim(self, lighthouse: str) -> None:
        """Mark the lighthouse as this job's, or check that it is: another secret's job is one error line.

        A proof that does not verify where this secret's job already keeps its rounds was forged (or is
        another job's, which cannot share a lighthouse with this one): it is mended, not obeyed."""
        proof = self.signer.sign(JOB_KEY, _PROOF)
        found = self.public.compare_set(JOB_KEY, "", proof)
        if self.signer.verify(JOB_KEY, found) == _PROOF:
            return
        if self.get("latest") is None:
            raise ConfigError(f"the live job at {lighthouse} is signed with another secret than this process's; give "
                              f"every process of the job the same {SECRET_ENV} (or --distributed-secret), or start "
                              f"a lighthouse of its own for a new job")
        self.public.compare_set(JOB_KEY, found.decode(errors="replace"), proof)

    def set(self, key: str, value: str) -> None:
        self.store.set(key, self.signer.sign(key, value))

    def get(self, key: str) -> Optional[str]:
        """``key``'s value if it is there and signed by this job, else ``None``."""
        if not self.store.check([key]):
            return None
        return self.signer.verify(key, self.store.get(key))

    def decide(self, key: str, value: str) -> None:
        """Write ``value`` unless a signed value is there already: one decision stands. A value that does not
        verify (it cannot be this job's) is replaced."""
        signed = self.signer.sign(key, value)
        found = self.store.compare_set(key, "", signed)
        if found != signed.encode() and self.signer.verify(key, found) is None:
            self.store.compare_set(key, found.decode(errors="replace"), signed)

    def add(self, key: str, amount: int) -> int:
        return int(self.store.add(key, amount))

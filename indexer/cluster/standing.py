"""A node's standing in its cluster: which vbuckets the map makes it active for, and whether it
may answer for them at all.

A node whose lease ran out may have been replaced by a failover while it was stopped or cut
off. So from the moment it cannot tell (its last keep-alive is older than the lease's TTL and
it was not even trying, as a stopped process does not, or etcd said the lease is gone) until it
has registered again and read the map after that, it is fenced: reads are refused with a 503,
and a merged scan reads the map again. A node that merely cannot reach etcd goes on answering
with the map it has: while etcd is unreachable no failover can be written either.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import trio


@dataclass
class ClusterStanding:
    """What the keep-alive learnt of the lease and the slice watch of the map (module doc)."""

    name: str
    ttl_s: float
    active: frozenset[int] | None = None  # in the map last read (None: not read yet)
    alive_at: float = field(default_factory=time.monotonic)  # the last keep-alive that held
    tried_at: float = field(default_factory=time.monotonic)  # the last try etcd did not answer
    lease_lost: bool = False  # etcd said so: fenced until the map is read after re-registering
    registered_at: float = 0.0  # when it registered again after losing the lease
    reread: trio.Event = field(default_factory=trio.Event)  # the map must be read again now

    def kept_alive(self) -> None:
        self.alive_at = self.tried_at = time.monotonic()

    def tried(self) -> None:
        """etcd did not answer: the node goes on with the map it has."""
        self.tried_at = time.monotonic()

    def lost(self) -> None:
        """etcd says the lease is gone: another node may be active in its place now."""
        self.lease_lost = True

    def registered_again(self) -> None:
        """Registered under a new lease; the map read from now on says what it is."""
        self.registered_at = time.monotonic()
        self.alive_at = self.tried_at = self.registered_at
        self.reread.set()

    def map_read(self, active: frozenset[int], read_at: float) -> None:
        """The map, read at `read_at` (monotonic), makes it active for `active`."""
        self.active = active
        if read_at >= self.registered_at and self.reread.is_set():
            self.lease_lost = False  # the map read since it registered again says what it is
            self.reread = trio.Event()

    def fenced(self) -> str | None:
        """Why it may not answer now, or None."""
        if self.lease_lost:
            return (
                f"node {self.name} lost its cluster lease (a failover may have replaced it): it "
                "answers again once it has read the map"
            )
        now = time.monotonic()
        if now - self.alive_at > self.ttl_s and now - self.tried_at > self.ttl_s / 2:
            return (
                f"node {self.name} has not renewed its cluster lease for "
                f"{now - self.alive_at:.0f} s (it was stopped?): it answers again once it has"
            )
        return None

"""Stability snapshots: the latest readable one, and the persisted one recorded in its own file.

A stability timestamp is a seqno (and vbuuid) per vbucket at which every mutation at or below it
is applied. The persisted timestamp lives in `snapshot.json` beside the store, written atomically
(write, fsync, rename, fsync the directory) with a CRC32 so a torn or edited file is detected.
"""

from __future__ import annotations

import json
import logging
import os
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from indexer.recovery import FailoverLog
from indexer.timestamps import StabilityTimestamp

SNAPSHOT_FILE = "snapshot.json"
FORMAT = 2  # 2 added recovery points and failover logs
READABLE_FORMATS = (1, 2)

log = logging.getLogger("indexer.snapshots")


class SnapshotFileError(Exception):
    """The persisted snapshot file is unreadable or fails its checksum."""


def _checksum(body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return f"{zlib.crc32(canonical):08x}"


@dataclass(frozen=True)
class RecoveryPoint:
    """A persisted snapshot the store can be brought back to (see `indexer.recovery`).

    `point` tags the undo records written after it. `clean` says the store held exactly the
    timestamp when the point was made (not also mutations flushed early under memory pressure):
    only clean points are rolled back to.
    """

    point: int
    timestamp: StabilityTimestamp
    persisted_at: float
    clean: bool = True


@dataclass(frozen=True)
class PersistedState:
    """What the snapshot file records: the persisted snapshot, older recovery points, and the
    failover log of every vbucket as of the persisted snapshot."""

    current: RecoveryPoint
    older: tuple[RecoveryPoint, ...] = ()  # newest first
    failover_logs: dict[int, FailoverLog] = field(default_factory=dict)
    cleared: bool = False  # rolled back to zero: the store must be emptied before use

    @classmethod
    def zero(cls, num_vbuckets: int) -> PersistedState:
        return cls(RecoveryPoint(0, StabilityTimestamp.zero(num_vbuckets), 0.0))

    @property
    def points(self) -> tuple[RecoveryPoint, ...]:
        """Every kept recovery point, newest first."""
        return (self.current, *self.older)


def _point_body(point: RecoveryPoint) -> dict[str, Any]:
    return {
        "point": point.point,
        "persisted_at": point.persisted_at,
        "seqnos": list(point.timestamp.seqnos),
        "vbuuids": list(point.timestamp.vbuuids),
        "clean": point.clean,
    }


def write_snapshot_file(data_dir: Path, state: PersistedState | StabilityTimestamp) -> None:
    """Record the persisted snapshot (and recovery points): atomic and durable (blocking)."""
    if isinstance(state, StabilityTimestamp):
        state = PersistedState(RecoveryPoint(0, state, time.time()))
    body: dict[str, Any] = {
        "format": FORMAT,
        **_point_body(state.current),
        "failover_logs": {
            str(vb): [list(entry) for entry in log] for vb, log in state.failover_logs.items()
        },
        "recovery_points": [_point_body(p) for p in state.older],
        "cleared": state.cleared,
    }
    body["checksum"] = _checksum(body)
    path = data_dir / SNAPSHOT_FILE
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(json.dumps(body).encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(data_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_snapshot_file(
    data_dir: Path, num_vbuckets: int
) -> tuple[StabilityTimestamp, float] | None:
    """The persisted timestamp and when it was written, or None if none was ever persisted."""
    state = read_persisted_state(data_dir, num_vbuckets)
    if state is None:
        return None
    return state.current.timestamp, state.current.persisted_at


def read_persisted_state(data_dir: Path, num_vbuckets: int) -> PersistedState | None:
    """Everything the snapshot file records, or None if none was ever persisted."""
    path = data_dir / SNAPSHOT_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        body = json.loads(raw)
        checksum = body.pop("checksum")
        if checksum != _checksum(body):
            raise SnapshotFileError(f"{path}: checksum mismatch")
        if body["format"] not in READABLE_FORMATS:
            raise SnapshotFileError(f"{path}: unknown format {body['format']}")
        current = _read_point(body, num_vbuckets, path)
        older = tuple(_read_point(p, num_vbuckets, path) for p in body.get("recovery_points", []))
        logs = {
            int(vb): tuple((int(u), int(s)) for u, s in log)
            for vb, log in body.get("failover_logs", {}).items()
        }
        cleared = bool(body.get("cleared", False))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SnapshotFileError(f"{path}: unreadable: {exc}") from None
    return PersistedState(current, older, logs, cleared)


def _read_point(body: dict[str, Any], num_vbuckets: int, path: Path) -> RecoveryPoint:
    seqnos = tuple(int(s) for s in body["seqnos"])
    vbuuids = tuple(int(u) for u in body["vbuuids"])
    if len(seqnos) != num_vbuckets or len(vbuuids) != num_vbuckets:
        raise SnapshotFileError(
            f"{path}: holds {len(seqnos)} vbuckets but the configuration has {num_vbuckets}"
        )
    return RecoveryPoint(
        int(body.get("point", 0)),
        StabilityTimestamp(seqnos, vbuuids),
        float(body["persisted_at"]),
        bool(body.get("clean", True)),
    )


class StabilitySnapshot:
    """A readable snapshot: its timestamp and the LevelDB snapshot that shows exactly it.

    The LevelDB snapshot stays open while the snapshot is the latest, the persisted one, pinned,
    or read by a scan (each holds a reference); the last reference out closes it.
    """

    def __init__(
        self,
        number: int,
        timestamp: StabilityTimestamp,
        store_snapshot: Any,
        entry_counts: dict[str, int] | None = None,
        held: bytes = b"",
        leaving: frozenset[int] = frozenset(),
    ) -> None:
        self.number = number
        self.timestamp = timestamp
        self.store_snapshot = store_snapshot
        # Entries per index name as the snapshot shows them: whole-index counts need no walk.
        self.entry_counts = entry_counts or {}
        # A flag per vbucket: the node received it when the snapshot was made, so the snapshot
        # holds its documents (a vbucket the node gave up since may be deleted already).
        self.held = held
        # Vbuckets given up whose documents were being deleted when it was made: the store may
        # still hold some of them, so an answer of this snapshot leaves them out.
        self.leaving = leaving
        self.created_at = time.time()
        self._refs = 0

    def acquire(self) -> StabilitySnapshot:
        self._refs += 1
        return self

    def release(self) -> None:
        self._refs -= 1
        if self._refs == 0 and self.store_snapshot is not None:
            self.store_snapshot.close()
            self.store_snapshot = None

    @property
    def is_open(self) -> bool:
        return self.store_snapshot is not None


@dataclass(frozen=True)
class SnapshotStatistics:
    stable_number: int
    stable_total: int
    persisted_total: int
    snapshots_published: int
    snapshots_persisted: int
    last_persist_lag_s: float
    pins: int


@dataclass
class Pin:
    """A snapshot held for readers under a lease; released on request or at expiry."""

    pin_id: str
    snapshot: StabilitySnapshot
    lease_s: float
    expires_at: float


class RolledBackError(Exception):
    """A failover rolled the index back while a request waited for a snapshot."""


class SnapshotStore:
    """The latest readable and persisted snapshots and the pinned ones; tasks wait here."""

    def __init__(self, persisted: StabilityTimestamp, owned: bytearray | None = None) -> None:
        self.owned = owned  # the node's vbuckets now, a flag each (None: all of them)
        self.leaving: set[int] = set()  # given up, their documents being deleted
        self.stable: StabilitySnapshot | None = None
        self.persisted = persisted
        self.persisted_snapshot: StabilitySnapshot | None = None
        self.pins: dict[str, Pin] = {}
        self._numbers = 0
        self._pin_numbers = 0
        self._published = 0
        self._persisted_count = 0
        self._persist_lag = 0.0
        self._changed = trio.Event()
        self.rollbacks = 0
        self.last_rollback: StabilityTimestamp | None = None

    def publish(
        self,
        timestamp: StabilityTimestamp,
        store_snapshot: Any,
        entry_counts: dict[str, int] | None = None,
    ) -> StabilitySnapshot:
        self._numbers += 1
        held = bytes(self.owned) if self.owned is not None else b""
        snapshot = StabilitySnapshot(
            self._numbers, timestamp, store_snapshot, entry_counts, held, frozenset(self.leaving)
        ).acquire()
        old = self.stable
        self.stable = snapshot
        if old is not None:
            old.release()
        self._published += 1
        self._wake()
        return snapshot

    def record_persisted(self, snapshot: StabilitySnapshot, lag_s: float) -> None:
        old = self.persisted_snapshot
        self.persisted_snapshot = snapshot.acquire()
        if old is not None:
            old.release()
        self.persisted = snapshot.timestamp
        self._persisted_count += 1
        self._persist_lag = lag_s
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self) -> None:
        """Return after the next publish or persist."""
        await self._changed.wait()

    async def wait_covering(self, seqnos: Iterable[tuple[int, int]]) -> StabilitySnapshot:
        """The first readable snapshot covering every (vbucket, seqno); cancel to give up.

        Raises RolledBackError if the index rolls back meanwhile: the seqnos waited for may
        belong to a history that no longer exists.
        """
        wanted = [(vb, s) for vb, s in seqnos if s > 0]
        rollbacks = self.rollbacks
        while True:
            stable = self.stable
            # A vbucket this node gave up meanwhile (a rebalance) never comes: not waited for.
            held = b"" if stable is None else stable.held
            if held and not all(held[vb] for vb, _ in wanted):
                wanted = [(vb, s) for vb, s in wanted if held[vb]]
            if stable is not None and stable.timestamp.covers(wanted):
                return stable
            await self.wait_changed()
            if self.rollbacks != rollbacks:
                assert self.last_rollback is not None
                raise RolledBackError(
                    "the index rolled back to an earlier snapshot after a failover of its source "
                    f"(seqnos summing to {self.last_rollback.total}) while this request waited; "
                    "retry it"
                )

    def roll_back(self, snapshot: StabilitySnapshot) -> None:
        """After a rollback: `snapshot` (published already) is both stable and persisted."""
        self.rollbacks += 1
        self.last_rollback = snapshot.timestamp
        self.record_persisted(snapshot, 0.0)

    def pin(self, snapshot: StabilitySnapshot, lease_s: float, pin_id: str | None = None) -> Pin:
        """Hold `snapshot` for `lease_s` seconds, as `pin_id` (a reader's: the next `pN`)."""
        if pin_id is None:
            self._pin_numbers += 1
            pin_id = f"p{self._pin_numbers}"
        self.unpin(pin_id)
        pin = Pin(pin_id, snapshot.acquire(), lease_s, time.monotonic() + lease_s)
        self.pins[pin.pin_id] = pin
        return pin

    def renew(self, pin_id: str, lease_s: float) -> Pin | None:
        """Extend a pin's lease to `lease_s` from now; None if it is gone."""
        pin = self.pins.get(pin_id)
        if pin is not None:
            pin.lease_s = lease_s
            pin.expires_at = time.monotonic() + lease_s
        return pin

    def unpin(self, pin_id: str) -> bool:
        pin = self.pins.pop(pin_id, None)
        if pin is None:
            return False
        pin.snapshot.release()
        return True

    def expire_pins(self) -> int:
        """Release pins whose lease ran out; how many."""
        now = time.monotonic()
        expired = [p.pin_id for p in self.pins.values() if p.expires_at <= now]
        for pin_id in expired:
            self.unpin(pin_id)
        return len(expired)

    def close(self) -> None:
        for pin_id in list(self.pins):
            self.unpin(pin_id)
        for snap in (self.stable, self.persisted_snapshot):
            if snap is not None:
                snap.release()
        self.stable = self.persisted_snapshot = None

    def statistics(self) -> SnapshotStatistics:
        return SnapshotStatistics(
            stable_number=self.stable.number if self.stable else 0,
            stable_total=self.stable.timestamp.total if self.stable else 0,
            persisted_total=self.persisted.total,
            snapshots_published=self._published,
            snapshots_persisted=self._persisted_count,
            last_persist_lag_s=self._persist_lag,
            pins=len(self.pins),
        )

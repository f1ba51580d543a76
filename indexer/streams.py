"""The stream rules of router connections, without I/O (sans-IO): what every vbucket stream has
delivered (`StreamRegistry`, shared by all connections) and the state of one connection
(`Connection`: messages in, accepted items out, or a ProtocolError). The reader (`reader.py`)
moves the bytes; an index build (`build.py`) keeps a registry of its own.

The items handed on are the `StreamItem`s every stage downstream takes: stream begins, snapshot
markers, mutation batches, and the `IndexChange` marker the catalog sends through the workers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import trio

from indexer import protocol as p
from indexer.protocol import ErrorCode, MutationBatch, ProtocolError, SnapshotMarker, StreamBegin
from indexer.recovery import FailoverLog


class IndexChange:
    """A marker sent through every worker's channel before the index definitions change.

    When every worker has taken it, everything received before the change is in the rings.
    """

    def __init__(self, workers: int) -> None:
        self._pending = workers
        self._arrived = trio.Event()

    def arrive(self) -> None:
        self._pending -= 1
        if self._pending == 0:
            self._arrived.set()

    async def wait(self) -> None:
        await self._arrived.wait()


StreamItem = StreamBegin | SnapshotMarker | MutationBatch | IndexChange


@dataclass(frozen=True)
class ReaderStatistics:
    connections: int
    connections_total: int
    frames: int
    mutations: int
    duplicates_skipped: int
    protocol_errors: int
    throttle_waits: int


class StreamRegistry:
    """What every vbucket stream has delivered, shared by all connections.

    `received[vb]` is the highest seqno handed to the pipeline: after a reconnect a router may
    resend from the persisted timestamp, and records at or below it are skipped as duplicates.
    """

    def __init__(
        self,
        owned: Sequence[int],
        persisted_seqnos: Sequence[int],
        failover_logs: dict[int, FailoverLog] | None = None,
        source: str | None = None,
        adopt_source: bool = False,
    ) -> None:
        n = len(persisted_seqnos)
        # The identity of the source whose history the node indexes (None: none yet), and
        # whether the first handshake of another source takes the node over (--adopt-source).
        self.source = source
        self.adopt_source = adopt_source
        # Per vbucket, the history (failover log) the received mutations belong to.
        self.failover_logs: dict[int, FailoverLog] = dict(failover_logs or {})
        self.owned = bytearray(n)
        for vb in owned:
            self.owned[vb] = 1
        self.received = list(persisted_seqnos)
        self.owner: list[int | None] = [None] * n
        self.last_in_stream = [0] * n  # highest seqno or marker end seen in the current stream
        self.marker_start = [0] * n
        self.marker_end = [-1] * n  # -1: no marker yet in this stream
        self.connections = 0
        self.connections_total = 0
        self.frames = 0
        self.mutations = 0
        self.duplicates = 0
        self.errors = 0
        self.throttle_waits = 0

    def statistics(self) -> ReaderStatistics:
        return ReaderStatistics(
            connections=self.connections,
            connections_total=self.connections_total,
            frames=self.frames,
            mutations=self.mutations,
            duplicates_skipped=self.duplicates,
            protocol_errors=self.errors,
            throttle_waits=self.throttle_waits,
        )


class Connection:
    """The protocol state of one router connection, without I/O: messages in, items out."""

    def __init__(
        self, conn_id: int, registry: StreamRegistry, nkeys: int, token: str | None = None
    ) -> None:
        self.conn_id = conn_id
        self.registry = registry
        self.nkeys = nkeys
        self.token = token  # the shared secret a handshake must carry (None: none needed)
        self.handshake: p.Handshake | None = None
        self.vbuckets: set[int] = set()
        # Set by the handshake: a source the node records before replying, and the source it
        # replaces when this router takes the node over (--adopt-source).
        self.new_source: str | None = None
        self.replaces: str | None = None
        self.claimed: set[int] = set()  # the vbuckets its handshake asked for

    def _check_vbucket(self, vb: int) -> None:
        reg = self.registry
        if vb >= len(reg.owned) or not reg.owned[vb]:
            raise ProtocolError(ErrorCode.NOT_MY_SLICE, f"vbucket {vb} is not owned by this node")

    def _check_streaming(self, vb: int) -> None:
        self._check_vbucket(vb)
        # Claimed by the handshake is not begun: STREAM_BEGIN comes first.
        if vb not in self.vbuckets or self.registry.owner[vb] != self.conn_id:
            raise ProtocolError(
                ErrorCode.STREAM_NOT_BEGUN, f"vbucket {vb} has no STREAM_BEGIN on this connection"
            )

    def accept(self, message: p.Message) -> StreamItem | None:
        """Check one message; the item to hand on (None if nothing), or ProtocolError."""
        reg = self.registry
        if self.handshake is None:
            if type(message) is not p.Handshake:
                raise ProtocolError(ErrorCode.BAD_HANDSHAKE, "the first frame must be HANDSHAKE")
            self._check_token(message)
            if message.num_vbuckets != len(reg.owned):
                raise ProtocolError(
                    ErrorCode.BAD_HANDSHAKE,
                    f"router uses {message.num_vbuckets} vbuckets, this node {len(reg.owned)}",
                )
            if not message.build:
                self._check_claim(message)
            self._check_source(message)
            self.handshake = message
            if not message.build:  # a build stream claims in its build's registry
                self.claim_vbuckets(message)
            return None
        if type(message) is p.MutationBatch:
            return self._accept_batch(message)
        if type(message) is p.SnapshotMarker:
            vb = message.vbucket
            self._check_streaming(vb)
            if message.start > message.end:
                raise ProtocolError(
                    ErrorCode.PROTOCOL, f"vbucket {vb}: marker start {message.start} > end"
                )
            after = max(reg.last_in_stream[vb], reg.marker_end[vb])
            if message.start <= after:
                raise ProtocolError(
                    ErrorCode.SEQNO_BACKWARDS,
                    f"vbucket {vb}: marker starts at {message.start}, not after {after}",
                )
            reg.marker_start[vb] = message.start
            reg.marker_end[vb] = message.end
            reg.last_in_stream[vb] = message.start - 1
            return message if message.end > reg.received[vb] else None
        if type(message) is p.StreamBegin:
            vb = message.vbucket
            self._check_vbucket(vb)
            owner = reg.owner[vb]
            if owner is not None and owner != self.conn_id:
                raise ProtocolError(
                    ErrorCode.STREAM_EXISTS, f"vbucket {vb} is streamed by another connection"
                )
            reg.owner[vb] = self.conn_id
            reg.last_in_stream[vb] = 0
            reg.marker_end[vb] = -1
            self.vbuckets.add(vb)
            if vb not in reg.failover_logs:
                # First used after the handshake (which had no log for it): its history is this
                # branch from 0, so a later failover of it is compared against something.
                reg.failover_logs[vb] = ((message.vbuuid, 0),)
            return message
        if type(message) is p.StreamEnd:
            self._check_streaming(message.vbucket)
            reg.owner[message.vbucket] = None
            return None
        if type(message) is p.Handshake:
            raise ProtocolError(ErrorCode.BAD_HANDSHAKE, "HANDSHAKE sent twice")
        raise ProtocolError(ErrorCode.PROTOCOL, f"{type(message).__name__} is not sent by routers")

    def _check_token(self, handshake: p.Handshake) -> None:
        """Refuse a handshake without the shared token before anything of it is used."""
        if self.token is None:
            return
        if not handshake.token:
            raise ProtocolError(
                ErrorCode.UNAUTHORIZED,
                "this indexer requires a token in the handshake (give the router --token-file, "
                "--token or INDEXER_TOKEN)",
            )
        if not p.token_matches(handshake.token, self.token):
            raise ProtocolError(ErrorCode.UNAUTHORIZED, "the handshake's token is wrong")

    def _check_claim(self, handshake: p.Handshake, what: str = "") -> None:
        """Routers of one source own disjoint vbuckets: a handshake asking for a vbucket that
        another connection streams is refused before anything of it is applied."""
        owner = self.registry.owner
        taken = [
            vb
            for vb in handshake.vbuckets
            if 0 <= vb < len(owner) and owner[vb] is not None and owner[vb] != self.conn_id
        ]
        if taken:
            raise ProtocolError(
                ErrorCode.STREAM_EXISTS,
                f"{what + ': ' if what else ''}{len(taken)} of the vbuckets this router asks for "
                f"are streamed by another connection (vbucket {taken[0]} the first): routers of "
                "one source own disjoint vbuckets (indexer router --vbucket-range)",
            )

    def claim_vbuckets(self, handshake: p.Handshake, what: str = "") -> None:
        """Make the vbuckets the handshake asks for this connection's until it ends, streamed
        yet or not (STREAM_EXISTS if another connection has one): a peer router of the same
        source is refused them at its handshake."""
        self._check_claim(handshake, what)
        reg = self.registry
        for vb in handshake.vbuckets:
            if 0 <= vb < len(reg.owned) and reg.owned[vb]:
                reg.owner[vb] = self.conn_id
                self.claimed.add(vb)

    def _check_source(self, handshake: p.Handshake) -> None:
        """A node indexes one source's history: the first one it sees is claimed here, another
        one is refused (before anything is rolled back) unless the node adopts it."""
        reg = self.registry
        identity = p.source_identity(handshake)
        if reg.source == identity:
            return
        if reg.source is None or (reg.adopt_source and not handshake.build):
            self.replaces = reg.source
            self.new_source = reg.source = identity
            reg.adopt_source = False
            return
        raise ProtocolError(
            ErrorCode.SOURCE_MISMATCH,
            f"this node indexes the history of {p.describe_source(reg.source)}, and this router "
            f"streams that of {p.describe_source(identity)}: refused, nothing rolled back. Point "
            "the router at its own nodes, or restart this node with `indexer serve "
            "--adopt-source` to drop what it holds and index the new source",
        )

    def _accept_batch(self, batch: p.MutationBatch) -> p.MutationBatch | None:
        reg = self.registry
        vb = batch.vbucket
        self._check_streaming(vb)
        if batch.nkeys != self.nkeys:
            raise ProtocolError(
                ErrorCode.BAD_MUTATION,
                f"records carry {batch.nkeys} keys, this node has {self.nkeys} indexes",
            )
        seqnos = batch.seqnos
        if not seqnos:
            return None
        end = reg.marker_end[vb]
        if end < 0:
            raise ProtocolError(
                ErrorCode.OUT_OF_SNAPSHOT, f"vbucket {vb}: mutations before a SNAPSHOT_MARKER"
            )
        last = reg.last_in_stream[vb]
        for seqno in seqnos:
            if seqno <= last:
                raise ProtocolError(
                    ErrorCode.SEQNO_BACKWARDS, f"vbucket {vb}: seqno {seqno} after {last}"
                )
            last = seqno
        if last > end:  # seqnos below the marker's start were refused as backwards
            raise ProtocolError(
                ErrorCode.OUT_OF_SNAPSHOT,
                f"vbucket {vb}: seqno {last} after the snapshot {reg.marker_start[vb]}-{end}",
            )
        reg.last_in_stream[vb] = last
        received = reg.received[vb]
        reg.mutations += len(seqnos)
        if seqnos[0] > received:
            reg.received[vb] = last
            return batch
        keep = [i for i, s in enumerate(seqnos) if s > received]
        reg.duplicates += len(seqnos) - len(keep)
        if not keep:
            return None
        reg.received[vb] = last
        return p.MutationBatch(
            vb,
            batch.nkeys,
            batch.payload,
            [seqnos[i] for i in keep],
            [batch.starts[i] for i in keep],
            [batch.lengths[i] for i in keep],
        )

    def release(self) -> None:
        """The connection is gone: its vbuckets may be streamed by another one."""
        for vb in self.vbuckets | self.claimed:
            if self.registry.owner[vb] == self.conn_id:
                self.registry.owner[vb] = None

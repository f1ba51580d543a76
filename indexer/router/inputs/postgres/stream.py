"""The replication stream of a followed table: its messages turned into documents and handed
to the appender in cuts, each ending at a whole transaction (or inside a large one, with how many
of its changes it holds), and the LSN the slot may confirm once a cut is synced.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, TypeGuard

import trio

from indexer.router.documents import Document
from indexer.router.inputs.postgres.pgoutput import (
    UNCHANGED,
    Begin,
    Commit,
    Delete,
    Insert,
    PgOutputError,
    Relation,
    Truncate,
    Update,
    Value,
    decode_message,
)
from indexer.router.inputs.postgres.pgtypes import (
    TypeCatalog,
)
from indexer.router.inputs.postgres.table import (
    Position,
    PostgresProgress,
    Shape,
    Table,
    shape_of,
)
from indexer.router.source.appender import Appender

log = logging.getLogger("indexer.router")

BATCH_CHANGES = 5_000  # changes of one transaction before a cut inside it
MAX_PENDING = 50_000  # changes read ahead of a busy appender, at most
MIN_CUT = 10_000  # changes a cut waits for while the stream keeps coming (fewer, larger appends)
FEEDBACK_S = 5.0  # how often the slot hears from the router when nothing else happens
COALESCE_S = 0.005  # how long an append waits for more of the stream to join it
YIELD_EVERY = 256  # messages read between two looks at the other tasks


class Follower(Protocol):
    """What the stream reader needs of the table's follower (`follower.TableFollower`)."""

    qualified: str
    types: TypeCatalog
    progress: PostgresProgress
    appender: Appender

    def document(
        self, shape: Shape, values: Sequence[Value], previous: dict[str, Any] | None = None
    ) -> Document: ...

    def row(self, table: Table, docid: str, xid: int) -> Document | None: ...

    def resolve_types(self, oids: list[int]) -> None: ...


@dataclass
class Cut:
    """Changes to append in one synced batch, where they leave the table, and the end LSN of
    the last whole transaction among them (what the slot may forget once they are synced)."""

    documents: list[Document]
    position: Position
    confirm: int | None
    oldest_commit: datetime | None


class StreamReader:
    """Turns the stream's messages into documents and hands them to the appender in cuts: as
    soon as it is free, or, past MAX_PENDING changes, waiting for it. A cut ends at a whole
    transaction, or inside a large one with how many of its changes it holds."""

    def __init__(self, follower: Follower, table: Table, position: Position):
        self.follower = follower
        self.table = table
        self.shape: Shape | None = None  # of the table's last Relation message
        self.held = position  # what the log held when streaming started: skipped
        self.pending: list[Document] = []
        self.pending_position: Position | None = None
        self.pending_confirm: int | None = None
        self.oldest_commit: datetime | None = None
        self.confirmed = position.lsn  # what the appender confirmed so far
        # The latest version of each document read and not yet in the log (pending, or in a
        # cut being appended): where an unchanged TOASTed value is taken from first.
        self.unsynced: dict[str, Document] = {}
        self.in_flight = 0  # cuts handed over and not appended yet
        # The end of the last transaction with nothing to append read while cuts were in flight.
        self.confirm_when_appended = position.lsn
        self._appended = trio.Event()
        self.idle = False  # the stream had nothing more when the last cut was handed over
        # The transaction being read: its commit LSN and time, its changes so far, and how many
        # of them the log already holds (-1: all).
        self.txn_lsn = 0
        self.txn_xid = 0
        self.txn_time: datetime | None = None
        self.txn_seen = 0
        self.txn_skip = 0

    def appended(self, confirmed: int, documents: list[Document]) -> None:
        """The appender finished a cut: its documents are the log's now."""
        unsynced = self.unsynced
        for document in documents:
            if unsynced.get(document.docid) is document:
                del unsynced[document.docid]
        self.in_flight -= 1
        self.confirmed = max(self.confirmed, confirmed)
        if not self.in_flight:
            self.confirmed = max(self.confirmed, self.confirm_when_appended)
        self._appended.set()
        self._appended = trio.Event()

    async def run(self, stream: Any, cur: Any, cuts: trio.MemorySendChannel[Cut]) -> None:
        fd = stream.fileno()
        last_feedback = time.monotonic()
        taken = 0
        while True:
            message = cur.read_message()
            if message is not None:
                self.idle = False
                await self.take(bytes(message.payload), cuts)
                taken += 1
                if taken % YIELD_EVERY == 0:
                    await trio.lowlevel.checkpoint()  # the node streams send meanwhile
                continue
            if self.pending_position is not None:
                # Nothing more for now; if more comes at once it joins the cut, else what is
                # whole goes to the appender. While it is busy the stream is read on, and
                # what comes meanwhile joins the cut: appends grow with the backlog.
                with trio.move_on_after(COALESCE_S) as waited:
                    await trio.lowlevel.wait_readable(fd)
                if not waited.cancelled_caught:
                    continue
                self.idle = True
                if not await self.hand_over(cuts, wait=False):
                    if self.in_flight:  # busy with a cut, which ends in `appended`
                        await self._readable_or_appended(fd)
                        continue
                    await self.hand_over(cuts, wait=True)  # not yet waiting for its first
            now = time.monotonic()
            if now - last_feedback >= FEEDBACK_S:
                cur.send_feedback(flush_lsn=self.confirmed, force=True)
                last_feedback = now
            with trio.move_on_after(FEEDBACK_S):
                await trio.lowlevel.wait_readable(fd)

    async def _readable_or_appended(self, fd: int) -> None:
        """Until the stream has more to read or the appender has finished its cut."""
        async with trio.open_nursery() as nursery:

            async def first(wait: Callable[[], Awaitable[object]]) -> None:
                await wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(first, lambda: trio.lowlevel.wait_readable(fd))
            nursery.start_soon(first, self._appended.wait)

    async def hand_over(self, cuts: trio.MemorySendChannel[Cut], wait: bool) -> bool:
        """Give what is pending to the appender: at once if it is free, else only with `wait`
        (then when it is). Whether it was given."""
        if self.pending_position is None:
            return True
        cut = Cut(self.pending, self.pending_position, self.pending_confirm, self.oldest_commit)
        try:
            cuts.send_nowait(cut)
        except trio.WouldBlock:
            if not wait:
                return False
            await cuts.send(cut)
        self.in_flight += 1
        self.pending, self.pending_position, self.pending_confirm = [], None, None
        if cut.position.done is None:
            self.oldest_commit = None
        return True

    async def drain(self, cuts: trio.MemorySendChannel[Cut]) -> None:
        """Until every cut handed over is in the log (changes of the open transaction not
        yet positioned stay pending: a TRUNCATE counts them itself)."""
        await self.hand_over(cuts, wait=True)
        while self.in_flight:
            await self._appended.wait()

    async def take(self, payload: bytes, cuts: trio.MemorySendChannel[Cut]) -> None:
        """One message of the stream."""
        message = decode_message(payload)
        if isinstance(message, Begin):
            self.txn_lsn, self.txn_time, self.txn_seen = message.final_lsn, message.commit_time, 0
            self.txn_xid = message.xid
            held = self.held
            if message.final_lsn < held.lsn or (
                message.final_lsn == held.lsn and held.done is None
            ):
                self.txn_skip = -1
            elif message.final_lsn == held.lsn:
                self.txn_skip = held.done or 0
            else:
                self.txn_skip = 0
        elif isinstance(message, Relation):
            if message.oid == self.table.oid:
                columns = [(c.name, c.type_oid) for c in message.columns]
                types = self.follower.types
                missing = types.missing(oid for _, oid in columns)
                if missing:  # a column of a type not seen yet (ALTER TABLE)
                    await trio.to_thread.run_sync(self.follower.resolve_types, missing)
                self.shape = shape_of(columns, self.table, types, message.replica_identity)
        elif isinstance(message, Commit):
            if self.txn_skip != -1 and self.txn_seen > self.txn_skip:
                # Some of it is new: its position is recorded whole even when a large
                # transaction's changes were all handed over before this Commit.
                self.follower.progress.transactions += 1
                self.pending_position = Position(self.txn_lsn)
            elif self.pending_position is None:
                # Nothing of it to append (held already, or no change of the table: before
                # PostgreSQL 15 every transaction comes, empty ones too). It may be confirmed
                # once every earlier cut is in the log, not while one is being appended.
                if self.in_flight:
                    self.confirm_when_appended = max(self.confirm_when_appended, message.end_lsn)
                else:
                    self.confirmed = max(self.confirmed, message.end_lsn)
                return
            self.pending_confirm = message.end_lsn
            if len(self.pending) >= MAX_PENDING:
                await self.hand_over(cuts, wait=True)
            elif len(self.pending) >= MIN_CUT:
                await self.hand_over(cuts, wait=False)
        elif self._ours(message):
            # Changes are counted by message: one appends all its documents at once, so a
            # restart in the middle of a transaction skips whole messages.
            self.txn_seen += 1
            if self.txn_skip == -1 or self.txn_seen <= self.txn_skip:
                self.follower.progress.skipped += 1
                return
            if self.oldest_commit is None:
                self.oldest_commit = self.txn_time
            if isinstance(message, Truncate):
                await self.drain(cuts)  # every earlier change in the log first
            documents = self._row_change(message)
            if documents is None:  # a TRUNCATE, or a value to find
                documents = await self._documents(message)
            self.pending += documents
            unsynced = self.unsynced
            for document in documents:
                unsynced[document.docid] = document
            if len(self.pending) >= BATCH_CHANGES:
                # A large transaction: hand over what it has so far, and say how far; only
                # once the appender is free (trying each change costs more than it reads).
                self.pending_position = Position(self.txn_lsn, done=self.txn_seen)
                full = len(self.pending) >= MAX_PENDING
                if full or not self.in_flight:
                    await self.hand_over(cuts, wait=full)

    def _ours(self, message: Any) -> TypeGuard[Insert | Update | Delete | Truncate]:
        if isinstance(message, Truncate):
            return self.table.oid in message.relations
        return isinstance(message, Insert | Update | Delete) and message.relation == self.table.oid

    def _row_change(self, message: Insert | Update | Delete | Truncate) -> list[Document] | None:
        """The documents of an insert, update or delete, without a coroutine (the common case);
        None for a TRUNCATE, or for an update that left a TOASTed value out which neither its
        old row nor a version not yet in the log gives (`_documents` looks further)."""
        shape = self.shape
        if shape is None or isinstance(message, Truncate):
            return None
        if isinstance(message, Delete):
            return [Document(str(message.old[shape.id_at]), None)]
        new = message.new
        if UNCHANGED not in new or (
            shape.doc_at is not None
            and new[shape.doc_at] is not UNCHANGED
            and new[shape.id_at] is not UNCHANGED
        ):  # with --doc-column, only that column and the id matter
            return self._keyed(message, self.follower.document(shape, new))
        assert isinstance(message, Update)
        progress = self.follower.progress
        old = message.old
        if shape.full_old_row and old is not None:  # REPLICA IDENTITY FULL: the old row, whole
            new = tuple(o if v is UNCHANGED else v for v, o in zip(new, old, strict=True))
            if UNCHANGED not in new:
                progress.unchanged_from_old_row += 1
                return self._keyed(message, self.follower.document(shape, new))
        previous = self.unsynced.get(self._previous_id(message))
        if previous is not None and fills(shape, new, previous):
            progress.unchanged_from_log += 1
            return self._keyed(message, self.follower.document(shape, new, previous.body))
        return None

    def _previous_id(self, message: Update) -> str:
        """The id under which the row's previous version is: the old key's, if it changed."""
        assert self.shape is not None
        at = self.shape.id_at
        old = message.old
        if old is not None and isinstance(old[at], str):
            return str(old[at])
        if not isinstance(message.new[at], str):
            raise PgOutputError(f"an update of {self.follower.qualified} without the row's id")
        return str(message.new[at])

    def _keyed(self, message: Insert | Update, document: Document | None) -> list[Document]:
        """The update's documents: a delete of the old id first when the key changed."""
        current = [] if document is None else [document]
        old = message.old if isinstance(message, Update) else None
        if old is None or not isinstance(old[self.shape.id_at], str):  # type: ignore[union-attr]
            return current
        old_id = str(old[self.shape.id_at])  # type: ignore[union-attr]
        new_id = message.new[self.shape.id_at]  # type: ignore[union-attr]
        if old_id != new_id:
            return [Document(old_id, None), *current]  # the key changed
        return current

    async def _documents(self, message: Insert | Update | Delete | Truncate) -> list[Document]:
        """The documents of a TRUNCATE, or of an update that left a TOASTed value out: taken
        from the row's latest version in the log, else from the row read once this change is
        visible (what it reads is this change or a later one, which follows in the stream)."""
        follower = self.follower
        source = follower.appender.source
        if isinstance(message, Truncate):
            survivors = await trio.to_thread.run_sync(source.surviving_documents)
            live = {docid for docid, document in survivors.items() if not document.deleted}
            # This transaction's changes before the TRUNCATE are not in the log yet.
            for document in self.pending:
                if document.deleted:
                    live.discard(document.docid)
                else:
                    live.add(document.docid)
            follower.progress.truncates += 1
            follower.progress.truncated_documents += len(live)
            log.warning("TRUNCATE of %s: deleting its %d documents", follower.qualified, len(live))
            return [Document(docid, None) for docid in sorted(live)]
        shape = self.shape
        if shape is None:
            raise PgOutputError("a change of the table before its Relation message")
        assert isinstance(message, Update)
        new = message.new
        if shape.full_old_row and message.old is not None:
            new = tuple(o if v is UNCHANGED else v for v, o in zip(new, message.old, strict=True))
        previous = await trio.to_thread.run_sync(source.latest_version, self._previous_id(message))
        if previous is not None and fills(shape, new, previous):
            follower.progress.unchanged_from_log += 1
            return self._keyed(message, follower.document(shape, new, previous.body))
        docid = new[shape.id_at]
        if not isinstance(docid, str):
            raise PgOutputError(f"an update of {follower.qualified} without the row's id")
        if follower.progress.unchanged_rows_read == 0:
            log.warning(
                "an update of row %r of %s left a TOASTed value out, and the log holds no "
                "version of the row to take it from: the row is read again once the update is "
                "visible (ALTER TABLE %s REPLICA IDENTITY FULL sends the old row instead)",
                docid,
                follower.qualified,
                follower.qualified,
            )
        follower.progress.unchanged_rows_read += 1
        row = await trio.to_thread.run_sync(follower.row, self.table, docid, self.txn_xid)
        return self._keyed(message, Document(docid, None) if row is None else row)


def fills(shape: Shape, values: Sequence[Value], previous: Document) -> bool:
    """Whether the previous version holds every value an update left out."""
    body = previous.body
    if body is None:
        return False
    if shape.doc_at is not None:
        return True  # the document is the one column: unchanged, it is the previous body
    return all(
        name in body for name, value in zip(shape.names, values, strict=True) if value is UNCHANGED
    )

"""The router's append stage: input documents go to the source log (one synced batch, off the
event loop), then to the Mutation Manager, and the node streams are woken.

Every input (a JSONL file, the generator, the HTTP API, a sharded router's parent) appends here,
so every document takes one path from its input to the streams.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import trio

from indexer.router.documents import Document, vbucket_of
from indexer.router.expiry import with_absolute_expiry
from indexer.router.source.log import SourceLog
from indexer.router.source.mutations import MutationManager
from indexer.router.source.recent import RecentDocuments
from indexer.router.source.visibility import Visibility

log = logging.getLogger("indexer.router")

READ_BYTES = 1 << 20  # of a JSONL input per read (parsed while the loop serves others)
MAX_APPEND_BYTES = 8 << 20  # of the JSONL input appended as one synced batch, at most


def append_bytes(capacity: int) -> int:
    """Input bytes per append: up to an eighth of the Mutation Manager's cap (a batch beyond it
    would drop every cursor at once), from one read to MAX_APPEND_BYTES."""
    return max(READ_BYTES, min(MAX_APPEND_BYTES, capacity // 8))


class Appender:
    """Appends documents to the source log, then to the Mutation Manager, one batch at a time,
    and wakes who waits for more."""

    def __init__(self, source: SourceLog, mm: MutationManager, ack_rule: str = "all") -> None:
        self.source = source
        self.mm = mm
        self.recent = RecentDocuments()
        self.lock = trio.Lock()
        self._changed = trio.Event()
        self.dropped = 0  # cursors dropped over the memory cap
        self.input_waiting = False  # an input has more to append than it has read
        self.expired = 0  # documents deleted by the expiry pager
        self.foreign = 0  # input documents of other routers' vbuckets, left to them
        # What the nodes can read (wait=visible), and which of a vbucket's owners it waits for.
        self.visibility = Visibility(self.wake, ack_rule)

    def next_change(self) -> trio.Event:
        """The event the next append sets."""
        return self._changed

    def owns(self, docid: str) -> bool:
        """Whether the document's vbucket is this router's (a peer owns a range of them)."""
        return self.source.owns(vbucket_of(docid.encode(), self.source.num_vbuckets))

    async def append(
        self, documents: Sequence[Document], input_position: bytes | None = None
    ) -> list[tuple[int, int]]:
        """Append (one synced batch, off the event loop); the (vbucket, seqno) of each document.

        A peer router (`--vbuckets`) keeps only its vbuckets' documents: the others are its
        peers' (each reads the same input), counted in `foreign` and left out. An
        `input_position` (a shard's place in its parent's input) is stored in the same batch,
        even when no document is left.
        """
        if self.source.vbuckets is not None:
            kept = [d for d in documents if self.owns(d.docid)]
            self.foreign += len(documents) - len(kept)
            documents = kept
        if not documents and input_position is None:
            return []
        async with self.lock:
            positions = await self._append_locked(documents, input_position)
        self.wake()
        return positions

    async def _append_locked(
        self, documents: Sequence[Document], input_position: bytes | None = None
    ) -> list[tuple[int, int]]:
        # The log's in-memory state changes in one step after the batch is written, so the
        # streaming tasks read either the log before this batch or after it. The manager
        # only gets what the log holds: a dropped cursor finds everything there.
        positions, documents, payloads = await trio.to_thread.run_sync(
            self._append, documents, input_position
        )
        self.recent.add(positions, documents)
        docids = [document.docid.encode() for document in documents]
        for backfill in self.mm.write_all(positions, docids, payloads):
            self.dropped += 1
            log.info(
                "%s fell behind on vbucket %d: it reads the source log from seqno %d",
                backfill.consumer,
                backfill.vbucket,
                backfill.after + 1,
            )
        return positions

    def wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _append(
        self, documents: Sequence[Document], input_position: bytes | None
    ) -> tuple[list[tuple[int, int]], list[Document], list[bytes | None]]:
        """Append (blocking): each document's position, its stored form and its payload."""
        now = time.time()
        # Stored with an absolute `_exp`: the manager's payloads must match the log.
        documents = [with_absolute_expiry(d, now) if d.has_expiry else d for d in documents]
        positions: list[tuple[int, int]] = []
        encoded: list[bytes] = []
        self.source.append(documents, now, encoded, input_position, positions)
        payloads = [
            None if d.deleted else value for d, value in zip(documents, encoded, strict=True)
        ]
        return positions, documents, payloads

    async def expire(self) -> int:
        """Delete the documents whose expiry has passed (the expiry pager's step); how many.

        Under the append lock: what is due is judged on the latest version of each document.
        """
        async with self.lock:
            due = await trio.to_thread.run_sync(self.source.due_expiries, time.time())
            if due:
                await self._append_locked([Document(docid, None) for docid in due])
                self.expired += len(due)
        if due:
            self.wake()
            log.info("expired %d documents", len(due))
        return len(due)

    async def failover(self, vbucket: int, seqno: int | None) -> tuple[int, int]:
        """Fail the vbucket's source over at `seqno` (default: its high seqno); (vbuuid, seqno).

        The manager forgets the vbucket; the caller makes the nodes handshake again.
        """
        async with self.lock:
            vbuuid, at = await trio.to_thread.run_sync(self.source.failover, vbucket, seqno)
            self.mm.reset_vbucket(vbucket, at)
            self.recent.forget(vbucket)  # its seqnos after `at` will name other documents
        return vbuuid, at

"""The latest appended documents, parsed, kept for the node streams: a stream that keeps up takes
a document from here instead of parsing the Mutation Manager's payload again."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

from indexer.router.documents import Document

RECENT_DOCUMENTS = 20_000
"""Parsed documents of the latest appends kept for the streams (not counted in the cap)."""


class RecentDocuments:
    """The latest appended documents, parsed, by (vbucket, seqno): streams that keep up take
    them from here instead of parsing the manager's payload again, once per stream."""

    def __init__(self, capacity: int = RECENT_DOCUMENTS) -> None:
        self.capacity = capacity
        self._documents: dict[tuple[int, int], Document] = {}

    def add(self, positions: Sequence[tuple[int, int]], documents: Sequence[Document]) -> None:
        found = self._documents
        for position, document in zip(positions, documents, strict=True):
            found[position] = document
        # The whole latest append stays, however big: the streams read it next.
        excess = len(found) - max(self.capacity, len(positions))
        if excess > 0:
            for position in list(islice(found, excess)):  # the oldest first
                del found[position]

    def get(self, vbucket: int, seqno: int) -> Document | None:
        return self._documents.get((vbucket, seqno))

    def forget(self, vbucket: int) -> None:
        """After a failover of the vbucket: its seqnos will be reused."""
        for position in [at for at in self._documents if at[0] == vbucket]:
            del self._documents[position]

"""The latest appended documents, parsed, kept for the node streams: a stream that keeps up takes
a document from here instead of parsing the Mutation Manager's payload again. Appends of
unparsed input lines are not kept: a document made from its payload costs no parse."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from indexer.router.documents import Document
from indexer.router.source.mutations import Item

RECENT_DOCUMENTS = 20_000
"""Parsed documents of the latest appends kept for the streams (not counted in the cap)."""
RECENT_APPENDS = 64
"""Appends kept at most: a lookup looks through each (appends of one document each, from the
HTTP API, are few documents, and a stream that misses one parses the payload)."""

Run = tuple[int, list[Document]]
"""A vbucket's documents of one append: the first one's seqno, then the next seqnos in order
(an append numbers each vbucket's documents one after another)."""


class RecentDocuments:
    """The documents of the latest appends, per append and vbucket: a lookup indexes a run, not
    a hash of each (vbucket, seqno). Held: the latest append, and older ones while the others
    hold fewer than `capacity` documents (at most RECENT_APPENDS appends)."""

    def __init__(self, capacity: int = RECENT_DOCUMENTS) -> None:
        self.capacity = capacity
        self._appends: deque[tuple[int, dict[int, Run]]] = deque()  # (size, runs), oldest first
        self._held = 0

    def add(self, positions: Sequence[tuple[int, int]], documents: Sequence[Document]) -> None:
        """Keep an append's documents if any holds a parsed body (an append of input lines,
        none parsed, is left out: a stream takes each from its payload as cheaply)."""
        if not any(document.holds_body for document in documents):
            return
        runs: dict[int, Run] = {}
        for (vb, seqno), document in zip(positions, documents, strict=True):
            run = runs.get(vb)
            if run is None:
                runs[vb] = (seqno, [document])
            else:
                run[1].append(document)
        self._appends.append((len(positions), runs))
        self._held += len(positions)
        # The whole latest append stays, however big: the streams read it next.
        appends = self._appends
        while len(appends) > 1 and (
            self._held - appends[0][0] >= self.capacity or len(appends) > RECENT_APPENDS
        ):
            self._held -= appends.popleft()[0]

    def get(self, vbucket: int, seqno: int) -> Document | None:
        for _, runs in reversed(self._appends):
            run = runs.get(vbucket)
            if run is not None:
                first, documents = run
                if first <= seqno < first + len(documents):
                    return documents[seqno - first]
        return None

    def documents(self, vbucket: int, items: Sequence[Item]) -> list[Document | None]:
        """The document of each item of the vbucket (in seqno order), None where not held."""
        found: list[Document | None] = [None] * len(items)
        if not items:
            return found
        low, high = items[0].seqno, items[-1].seqno
        for _, runs in self._appends:
            run = runs.get(vbucket)
            if run is None:
                continue
            first, documents = run
            end = first + len(documents)
            if end <= low or first > high:
                continue
            for i, item in enumerate(items):
                seqno = item.seqno
                if first <= seqno < end:
                    found[i] = documents[seqno - first]
        return found

    def forget(self, vbucket: int) -> None:
        """After a failover of the vbucket: its seqnos will be reused."""
        for _, runs in self._appends:
            runs.pop(vbucket, None)

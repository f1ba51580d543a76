"""The snapshot start of the change feed: the entries of an index at a mark, in index order,
from any position, so that the start of a large index is read in pages like its changes.

While the store snapshot of the mark is open (the feed pins it for the pages' reader) the
entries are read from it. Once it is gone (the pin expired, or the daemon restarted), they are
rebuilt from a later snapshot with the changes since the mark taken back: a page resumes at the
same place either way, as long as the history from the mark is kept (the feed holds it under a
lease of its own while pages come)."""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterator
from itertools import islice
from typing import Any

from indexer.changes import ChangeHistory, ChangeToken
from indexer.keys import entry_tail, split_tail
from indexer.scans import VbucketFilter
from indexer.storage import IndexStore, StoredIndex

PAGES_LEASE_S = 120.0
"""How long the feed keeps a paged snapshot start's pin and its hold on the history after a
page: every page renews both."""


def pages_lease(mark: int) -> str:
    """The name of the feed's own lease on the history of a paged start at `mark` (a consumer's
    name cannot hold `~`)."""
    return f"~snapshot-pages.{mark}"


def pages_pin(history_id: str, mark: int) -> str:
    """The id of the feed's pin of the store snapshot at `mark` (a reader's pins are `pN`)."""
    return f"changes.{history_id}.{mark}"


class SnapshotStart:
    """The entries of `index` at one mark (blocking reads: run them in a thread).

    `exact` is a store snapshot at the mark. Without one, `later` is a store snapshot at the
    later mark `until`, and the entries are its own with the changes from the mark to `until`
    taken back: memory holds the documents that changed, never the index."""

    def __init__(
        self,
        store: IndexStore,
        index: StoredIndex,
        exact: Any = None,
        later: Any = None,
        history: ChangeHistory | None = None,
        mark: int = 0,
        until: int = 0,
        source: Any = None,
        only: VbucketFilter | None = None,
    ) -> None:
        self.store = store
        self.only = only  # the vbuckets whose entries it gives (None: all)
        self.index = index
        self.exact = exact
        self.later = later
        self.changed: set[bytes] = set()
        self.rebuilt: list[bytes] = []  # the changed documents' entries at the mark, sorted
        if exact is None:
            assert later is not None and history is not None
            self._take_back(history, mark, until, source)

    def _take_back(self, history: ChangeHistory, mark: int, until: int, source: Any) -> None:
        """The value each changed document had at the mark: that of its first change after
        it (a document's changes are in seqno order within its vbucket)."""
        at_mark: dict[bytes, bytes] = {}
        token = ChangeToken(history.history_id, mark)
        blocks, _ = history.read_records(self.index, token, until, source)
        for block in blocks:
            for docid, old in zip(block.docids, block.olds, strict=True):
                at_mark.setdefault(docid, old)
        array = self.index.array
        entry_keys = self.index.entry_keys
        rebuilt = []
        for docid, old in at_mark.items():
            keys = entry_keys(old) if array else ([old] if old else [])
            tail = entry_tail(docid)
            rebuilt += [key + tail for key in keys]
        rebuilt.sort()
        self.changed = set(at_mark)
        self.rebuilt = rebuilt

    def entries(self, after: bytes | None = None, through: bytes | None = None) -> Iterator[bytes]:
        """The entries after `after` (excluded) up to `through` (included), in index order."""
        found = self._entries(after, through)
        return found if self.only is None else self.only.entries(found)

    def _entries(self, after: bytes | None, through: bytes | None) -> Iterator[bytes]:
        if self.exact is not None:
            yield from self.store.main_range(self.index, self.exact, after, through)
            return
        later = self.store.main_range(self.index, self.later, after, through)
        changed = self.changed
        if not changed:  # nothing changed since the mark: the later snapshot's entries
            yield from later
            return
        rebuilt = self.rebuilt
        low = 0 if after is None else bisect.bisect_right(rebuilt, after)
        high = len(rebuilt) if through is None else bisect.bisect_right(rebuilt, through)
        kept = (entry for entry in later if split_tail(entry)[1] not in changed)
        yield from heapq.merge(kept, islice(rebuilt, low, high))

    def page_end(self, after: bytes | None, limit: int) -> bytes | None:
        """The last entry of a page of `limit` entries after `after`; None when the start
        ends within that page (the page then ends at the start's end)."""
        last = None
        for count, entry in enumerate(self.entries(after), 1):
            if count == limit:
                last = entry
            elif count > limit:
                return last
        return None

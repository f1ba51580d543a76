"""The state directory of a sharded router: its layout (fixed when the directory is made: the
source identity, the vbuckets, the shards) and the lock that keeps a second router out."""

from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import uuid
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path

from indexer.router.documents import vbucket_of
from indexer.router.source.log import STATE_DIR, SourceError

log = logging.getLogger("indexer.router")

LAYOUT_FILE = "shards.json"
LOCK_FILE = "router.lock"


@dataclass(frozen=True)
class ShardLayout:
    """How a sharded router's vbuckets are split: K contiguous ranges of one source."""

    identity: str
    num_vbuckets: int
    count: int

    def ranges(self) -> list[tuple[int, int]]:
        """(first, last) vbucket of each shard."""
        n, k = self.num_vbuckets, self.count
        return [(i * n // k, (i + 1) * n // k - 1) for i in range(k)]

    @functools.cached_property
    def _owners(self) -> list[int]:
        starts = [first for first, _ in self.ranges()]
        return [bisect_right(starts, vb) - 1 for vb in range(self.num_vbuckets)]

    def owners(self) -> list[int]:
        """The shard of each vbucket."""
        return self._owners

    def shard_of(self, docid: str) -> int:
        return self._owners[vbucket_of(docid.encode(), self.num_vbuckets)]


def open_layout(
    state: Path, count: int, num_vbuckets: int | None, identity: str | None
) -> ShardLayout:
    """The state directory's layout, made on first use (SourceError: one line saying why not)."""
    if (state / STATE_DIR).is_dir():
        raise SourceError(
            f"{state} holds the source log of a router without shards: run it without --shards "
            "(or give --shards a new --state)"
        )
    path = state / LAYOUT_FILE
    if path.exists():
        try:
            item = json.loads(path.read_text())
            layout = ShardLayout(str(item["identity"]), int(item["vbuckets"]), int(item["shards"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SourceError(f"{path} is unreadable: {exc}") from None
        if layout.count != count:
            raise SourceError(
                f"{state} was made with --shards {layout.count}: a state directory keeps its "
                f"shard count (run with --shards {layout.count}, or give a new --state)"
            )
        if num_vbuckets is not None and num_vbuckets != layout.num_vbuckets:
            raise SourceError(f"{state} has {layout.num_vbuckets} vbuckets, not {num_vbuckets}")
        if identity is not None and identity != layout.identity:
            raise SourceError(f"{state} has source id {layout.identity}, not {identity}")
        return layout
    n = 1024 if num_vbuckets is None else num_vbuckets
    if count > n:
        raise SourceError(f"--shards {count} is more than the {n} vbuckets")
    layout = ShardLayout(identity or uuid.uuid4().hex, n, count)
    body = {"identity": layout.identity, "vbuckets": n, "shards": count}
    try:
        state.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".tmp")
        with open(temporary, "w") as f:
            json.dump(body, f)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
        directory = os.open(state, os.O_RDONLY)  # the new name survives a power cut
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except OSError as exc:
        raise SourceError(f"cannot create {path}: {exc.strerror}") from None
    return layout


def lock_state(state: Path) -> int:
    """Hold the state directory for this process (SourceError if another router has it)."""
    fd = os.open(state / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SourceError(f"another router runs on {state}") from None
    return fd

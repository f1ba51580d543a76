"""Memory snapshots encoded once for the streams of every node that would encode them alike
(replicas, `--to` twice), kept by size."""

from __future__ import annotations

SHARED_FRAMES_BYTES = 32 << 20
"""Encoded snapshots kept for the streams of nodes with the same index definitions."""

FramesKey = tuple[object, ...]
Pieces = list[tuple[list[bytes], int]]


class SharedFrames:
    """Memory snapshots encoded once for every node with the same index definitions and frame
    sizes (replicas, `--to` twice): by those, the vbucket's vbuuid and the snapshot's range,
    which name its items exactly. The oldest go first past `capacity` bytes."""

    def __init__(self, capacity: int = SHARED_FRAMES_BYTES) -> None:
        self.capacity = capacity
        self.bytes = 0
        self.hits = 0
        self._pieces: dict[FramesKey, tuple[Pieces, int]] = {}

    def get(self, key: FramesKey) -> Pieces | None:
        found = self._pieces.get(key)
        if found is None:
            return None
        self.hits += 1
        return found[0]

    def put(self, key: FramesKey, pieces: Pieces) -> None:
        size = sum(len(frame) for frames, _ in pieces for frame in frames)
        if key in self._pieces or size > self.capacity:
            return
        self._pieces[key] = (pieces, size)
        self.bytes += size
        while self.bytes > self.capacity:
            oldest = next(iter(self._pieces))
            self.bytes -= self._pieces.pop(oldest)[1]

"""Preallocated slab pool for queued mutation records (after couchbase's go-slab).

Slabs serve one size class at a time and return to the empty list when all their chunks are free.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import outcome
import trio

__all__ = ["SlabPool", "SlabStatistics"]


@dataclass(frozen=True, slots=True)
class SlabStatistics:
    """A snapshot of a :class:`SlabPool`'s occupancy and counters."""

    total_bytes: int
    slab_bytes: int
    slabs_total: int
    slabs_empty: int
    chunks_in_use: int
    chunk_bytes_in_use: int
    payload_bytes_in_use: int
    waiting: int
    allocations: int
    waits: int


class _Waiter:
    """A task parked in :meth:`SlabPool.alloc_many`, with its request pre-sorted by class."""

    __slots__ = ("need", "sizes", "task")

    def __init__(self, sizes: Sequence[int], need: list[tuple[int, int]], task: trio.lowlevel.Task):
        self.sizes = sizes
        self.need = need
        self.task = task


class SlabPool:
    """Chunk allocator over one preallocated arena; a chunk handle is its offset in the arena.

    Batch methods take and return plain lists; ``alloc_many`` waits (FIFO) until chunks are freed.
    """

    def __init__(
        self,
        total_bytes: int,
        slab_bytes: int = 1 << 20,
        min_chunk: int = 64,
        growth: int = 2,
    ) -> None:
        if min_chunk < 1:
            raise ValueError(f"min_chunk must be >= 1, got {min_chunk}")
        if growth < 2:
            raise ValueError(f"growth must be an integer >= 2, got {growth}")
        if slab_bytes < min_chunk:
            raise ValueError(f"slab_bytes ({slab_bytes}) must be >= min_chunk ({min_chunk})")
        nslabs = total_bytes // slab_bytes
        if nslabs < 1:
            raise ValueError(
                f"total_bytes ({total_bytes}) is smaller than one slab ({slab_bytes} bytes);"
                " the pool needs at least one whole slab"
            )
        self._slab_bytes = slab_bytes
        self._min_chunk = min_chunk
        self._nslabs = nslabs
        self._total = nslabs * slab_bytes
        self._arena = bytearray(self._total)
        # A held export pins the arena: any accidental resize raises BufferError.
        self._view = memoryview(self._arena)

        # Size classes and the table from ceil(size / min_chunk) to class index.
        csizes: list[int] = []
        size = min_chunk
        while size <= slab_bytes:
            csizes.append(size)
            size *= growth
        self._csize = csizes
        self._per_slab = [slab_bytes // c for c in csizes]
        table = bytearray(csizes[-1] // min_chunk + 1)
        k = 0
        for q in range(len(table)):
            while csizes[k] < q * min_chunk:
                k += 1
            table[q] = k
        self._class_of = bytes(table)

        # Per-slab state; index ``nslabs`` is a permanently full dummy used as "no current slab".
        dummy = nslabs
        self._dummy = dummy
        self._slab_cls = [-1] * (nslabs + 1)
        self._free: list[list[int]] = [[] for _ in range(nslabs + 1)]
        self._ncarved = [0] * (nslabs + 1)
        self._lim = [0] * (nslabs + 1)
        self._slab_csize = [0] * (nslabs + 1)
        # Per-class state: the slab being allocated from and other slabs with free chunks.
        self._cur = [dummy] * len(csizes)
        self._partial: list[list[int]] = [[] for _ in csizes]
        self._empty = list(range(nslabs - 1, -1, -1))
        # One live flag per min_chunk unit: chunk starts are at least min_chunk apart.
        self._live = bytearray(self._total // min_chunk + 1)

        self._payload = 0
        self._allocations = 0
        self._waits = 0
        self._waiters: deque[_Waiter] = deque()

    # ----------------------------------------------------------------- properties

    @property
    def max_record(self) -> int:
        """Largest record the pool can hold (the largest chunk size)."""
        return self._csize[-1]

    @property
    def chunk_sizes(self) -> list[int]:
        """The size classes, smallest first."""
        return list(self._csize)

    def chunk_size(self, chunk: int) -> int:
        """Size of the chunk at ``chunk`` (its slab's class size); 0 if the slab is unassigned."""
        return self._slab_csize[chunk // self._slab_bytes]

    # ----------------------------------------------------------------- allocation

    def try_alloc_many(self, sizes: Sequence[int]) -> list[int] | None:
        """Allocate one chunk per size, all or nothing; None (nothing kept) if they do not fit now.

        Ignores queued :meth:`alloc_many` waiters (a synchronous caller may overtake them).
        """
        if not sizes:
            return []
        if min(sizes) < 0:
            raise ValueError("record sizes must be >= 0")
        mc = self._min_chunk
        mcm1 = mc - 1
        table = self._class_of
        cur = self._cur
        free = self._free
        ncarved = self._ncarved
        lim = self._lim
        live = self._live
        csize = self._csize
        sb = self._slab_bytes
        out: list[int] = []
        append = out.append
        size = 0
        try:
            for size in sizes:
                c = table[(size + mcm1) // mc]
                s = cur[c]
                fl = free[s]
                if fl:
                    off = fl.pop()
                else:
                    k = ncarved[s]
                    if k < lim[s]:
                        ncarved[s] = k + 1
                        off = s * sb + k * csize[c]
                    else:
                        off = self._refill(c)
                        if off < 0:
                            self._release(out)
                            return None
                live[off // mc] = 1
                append(off)
        except IndexError:
            self._release(out)
            raise ValueError(
                f"record of {size} bytes exceeds the largest chunk ({self.max_record} bytes)"
            ) from None
        self._payload += sum(sizes)
        self._allocations += len(out)
        return out

    def _refill(self, c: int) -> int:
        """Make another slab current for class ``c`` and take one chunk from it; -1 if none."""
        part = self._partial[c]
        if part:
            s = part.pop()
        elif self._empty:
            s = self._empty.pop()
            self._slab_cls[s] = c
            self._lim[s] = self._per_slab[c]
            self._slab_csize[s] = self._csize[c]
            self._ncarved[s] = 0
        else:
            return -1
        # The previous current slab is full, so it is simply dropped (a free re-lists it).
        self._cur[c] = s
        fl = self._free[s]
        if fl:
            return fl.pop()
        k = self._ncarved[s]
        self._ncarved[s] = k + 1
        return s * self._slab_bytes + k * self._csize[c]

    def _need(self, sizes: Sequence[int]) -> list[tuple[int, int]]:
        """Chunks needed per class; ValueError if the request could never fit in this pool."""
        if min(sizes) < 0:
            raise ValueError("record sizes must be >= 0")
        mc = self._min_chunk
        mcm1 = mc - 1
        table = self._class_of
        counts = [0] * len(self._csize)
        try:
            for size in sizes:
                counts[table[(size + mcm1) // mc]] += 1
        except IndexError:
            raise ValueError(
                f"record of {max(sizes)} bytes exceeds the largest chunk ({self.max_record} bytes)"
            ) from None
        need = [(c, n) for c, n in enumerate(counts) if n]
        slabs = sum(-(-n // self._per_slab[c]) for c, n in need)
        if slabs > self._nslabs:
            raise ValueError(
                f"request for {len(sizes)} records ({sum(sizes)} bytes) needs {slabs} slabs"
                f" but the pool has only {self._nslabs}; it can never be satisfied"
            )
        return need

    def _fits(self, need: list[tuple[int, int]]) -> bool:
        """Whether a request with these per-class counts would be satisfied right now."""
        empties = len(self._empty)
        free = self._free
        for c, n in need:
            s = self._cur[c]
            avail = len(free[s]) + self._lim[s] - self._ncarved[s]
            if avail < n:
                for p in self._partial[c]:
                    avail += len(free[p])
            if avail < n:
                empties -= -(-(n - avail) // self._per_slab[c])
                if empties < 0:
                    return False
        return True

    async def alloc_many(self, sizes: Sequence[int]) -> list[int]:
        """Allocate one chunk per size, waiting (first come, first served) until they fit.

        Raises ValueError at once for a record above ``max_record`` or a request larger than
        the whole pool.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self._waiters:
            got = self.try_alloc_many(sizes)
            if got is not None:
                await trio.lowlevel.cancel_shielded_checkpoint()
                return got
        waiter = _Waiter(sizes, self._need(sizes), trio.lowlevel.current_task())
        self._waiters.append(waiter)
        self._waits += 1

        def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
            self._waiters.remove(waiter)
            self._serve_waiters()
            return trio.lowlevel.Abort.SUCCEEDED

        chunks: list[int] = await trio.lowlevel.wait_task_rescheduled(abort)
        return chunks

    def _serve_waiters(self) -> None:
        """Hand freed chunks to parked waiters in arrival order while the head one fits."""
        waiters = self._waiters
        while waiters:
            w = waiters[0]
            if not self._fits(w.need):
                return
            got = self.try_alloc_many(w.sizes)
            if got is None:  # pragma: no cover - _fits is exact
                return
            waiters.popleft()
            trio.lowlevel.reschedule(w.task, outcome.Value(got))

    # ----------------------------------------------------------------- free

    def free_many(self, chunks: Sequence[int], sizes: Sequence[int]) -> None:
        """Return chunks to their slabs; ``sizes`` are the payload sizes given at allocation.

        Raises ValueError (and frees nothing) if any chunk is not currently allocated.
        """
        if len(chunks) != len(sizes):
            raise ValueError(f"{len(chunks)} chunks but {len(sizes)} sizes")
        if not chunks:
            return
        mc = self._min_chunk
        live = self._live
        if min(chunks) < 0:
            raise ValueError(f"chunk offset {min(chunks)} is not an allocated chunk")
        # Pass 1: clear the live flags, undoing them if any chunk is not allocated.
        done = 0
        try:
            for off in chunks:
                i = off // mc
                if not live[i]:
                    break
                live[i] = 0
                done += 1
        except IndexError:
            pass
        if done != len(chunks):
            bad = chunks[done]
            for off in chunks[:done]:
                live[off // mc] = 1
            raise ValueError(f"chunk offset {bad} is not an allocated chunk (double free?)")
        self._put_back(chunks)
        self._payload -= sum(sizes)
        if self._waiters:
            self._serve_waiters()

    def _release(self, chunks: list[int]) -> None:
        """Undo a partial allocation (rollback for all-or-nothing)."""
        mc = self._min_chunk
        live = self._live
        for off in chunks:
            live[off // mc] = 0
        self._put_back(chunks)

    def _put_back(self, chunks: Sequence[int]) -> None:
        """Push chunks onto their slabs' free lists, re-listing full slabs, returning empty ones."""
        sb = self._slab_bytes
        free = self._free
        ncarved = self._ncarved
        lim = self._lim
        for off in chunks:
            s = off // sb
            fl = free[s]
            fl.append(off)
            n = len(fl)
            if n == ncarved[s]:
                self._slab_emptied(s)
            elif n == 1 and ncarved[s] == lim[s]:
                # It was full; unless it is still its class's current slab, list it again.
                c = self._slab_cls[s]
                if self._cur[c] != s:
                    self._partial[c].append(s)

    def _slab_emptied(self, s: int) -> None:
        """Give a slab whose chunks are all free back to the global empty list."""
        c = self._slab_cls[s]
        if self._cur[c] == s:
            self._cur[c] = self._dummy
        elif self._lim[s] > 1:
            # A non-current slab with >1 chunk that just became empty had free chunks: listed.
            self._partial[c].remove(s)
        self._free[s] = []
        self._ncarved[s] = 0
        self._lim[s] = 0
        self._slab_cls[s] = -1
        self._slab_csize[s] = 0
        self._empty.append(s)

    # ----------------------------------------------------------------- data

    def write(self, chunk: int, data: bytes | memoryview) -> None:
        """Copy ``data`` into the chunk at offset ``chunk``."""
        n = len(data)
        if n > self._slab_csize[chunk // self._slab_bytes]:
            raise ValueError(f"{n} bytes do not fit the chunk at {chunk}")
        self._view[chunk : chunk + n] = data

    def write_many(self, chunks: Sequence[int], datas: Sequence[bytes | memoryview]) -> None:
        """Copy each record into its chunk (``chunks[i]`` receives ``datas[i]``)."""
        if len(chunks) != len(datas):
            raise ValueError(f"{len(chunks)} chunks but {len(datas)} records")
        view = self._view
        sb = self._slab_bytes
        csz = self._slab_csize
        for off, d in zip(chunks, datas, strict=False):
            n = len(d)
            if n > csz[off // sb]:
                raise ValueError(f"{n} bytes do not fit the chunk at {off}")
            view[off : off + n] = d

    def copy_in(
        self,
        chunks: Sequence[int],
        source: bytes,
        starts: Sequence[int],
        lengths: Sequence[int],
    ) -> None:
        """Copy records found at ``source[starts[i]:starts[i]+lengths[i]]`` into ``chunks[i]``.

        The chunks must come from one allocation of these lengths, so each record fits.
        """
        view = self._view
        src = memoryview(source)
        for off, start, n in zip(chunks, starts, lengths, strict=True):
            view[off : off + n] = src[start : start + n]

    @property
    def records(self) -> memoryview:
        """The whole arena, to read allocated chunks in place (never write through it)."""
        return self._view

    def read(self, chunk: int, length: int) -> bytes:
        """Copy ``length`` bytes out of the chunk at offset ``chunk``."""
        return self._view[chunk : chunk + length].tobytes()

    def read_many(self, chunks: Sequence[int], lengths: Sequence[int]) -> list[bytes]:
        """Copy each record out of its chunk."""
        if len(chunks) != len(lengths):
            raise ValueError(f"{len(chunks)} chunks but {len(lengths)} lengths")
        view = self._view
        return [view[o : o + n].tobytes() for o, n in zip(chunks, lengths, strict=False)]

    def view(self, chunk: int, length: int) -> memoryview:
        """A zero-copy view of a record; valid only until the chunk is freed."""
        return self._view[chunk : chunk + length]

    # ----------------------------------------------------------------- statistics

    def statistics(self) -> SlabStatistics:
        """Occupancy and counters; O(number of slabs)."""
        chunks = 0
        chunk_bytes = 0
        free = self._free
        for s in range(self._nslabs):
            if self._slab_cls[s] >= 0:
                used = self._ncarved[s] - len(free[s])
                chunks += used
                chunk_bytes += used * self._slab_csize[s]
        return SlabStatistics(
            total_bytes=self._total,
            slab_bytes=self._slab_bytes,
            slabs_total=self._nslabs,
            slabs_empty=len(self._empty),
            chunks_in_use=chunks,
            chunk_bytes_in_use=chunk_bytes,
            payload_bytes_in_use=self._payload,
            waiting=len(self._waiters),
            allocations=self._allocations,
            waits=self._waits,
        )

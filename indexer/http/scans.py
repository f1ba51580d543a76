"""Scans, counts, splits and pins: reads of a snapshot at a chosen consistency."""

from __future__ import annotations

import base64
import functools
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import islice
from typing import Any

import pyarrow as pa
import trio

from indexer.aggregates import (
    Aggregate,
    AggregateError,
    aggregate,
    decoded_values,
    parse_aggregates,
)
from indexer.client import (
    ACTIVE_HEADER,
    NDJSON,
    NEXT_HEADER,
    RETRY_AFTER,
    SEQNO_SUM_HEADER,
    SNAPSHOT_HEADER,
    VBUCKETS_HEADER,
)
from indexer.cluster.map import ClusterMapError, parse_vbuckets, vbucket_ranges
from indexer.http.admin import AdminRoutes
from indexer.http.wire import (
    ARROW,
    CONSISTENCIES,
    DEFAULT_LEASE_S,
    DEFAULT_TIMEOUT_S,
    MAX_LEASE_S,
    SCAN_CHUNK,
    ApiError,
    Projection,
    Send,
    _arrow_chunk,
    _Chunks,
    _hex,
    _json,
    _ndjson_chunk,
    _number,
    _projection,
    _RowCount,
    _start,
    _vector,
)
from indexer.protocol import IndexDefinition
from indexer.scans import (
    COLUMN_KINDS,
    Bounds,
    EntryBatch,
    KeyRange,
    VbucketFilter,
    after,
    column_kind,
    count_entries,
    entry_batches,
    json_encode,
    key_range,
    key_types,
    lookup,
    merge_spans,
    more_than,
    page,
    page_batches,
    parse_json_param,
    splits,
    string_prefix_range,
)
from indexer.snapshots import RolledBackError, StabilitySnapshot
from indexer.storage import StoredIndex

log = logging.getLogger("indexer.http")


TYPES_CACHE = 16  # answers of /types kept, by index and snapshot
MAX_SPANS = 1024  # ranges in one scan's spans


def _column_kinds(text: str | None, count: int) -> list[str]:
    """The `columns` parameter of an Arrow scan: a kind per key position (default all json)."""
    if text is None:
        return ["json"] * count
    kinds = text.split(",")
    if len(kinds) != count or any(k not in COLUMN_KINDS for k in kinds):
        raise ApiError(
            400,
            f"columns: {count} comma-separated kinds, one per key, of "
            f"{', '.join(COLUMN_KINDS)}; not {text!r}",
        )
    return kinds


PAGE_LEASE_S = 120.0  # the lease of a pin made for pages, renewed by every page


@dataclass(frozen=True)
class Continuation:
    """What a `next` token says: the index, the pin of the pages' snapshot (and whether the
    daemon made it for them), the last entry read and the order."""

    index: str
    pin: str
    ours: bool
    after: bytes
    descending: bool

    def encode(self) -> str:
        value = [self.index, self.pin, self.ours, self.after.hex(), self.descending]
        return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")

    @classmethod
    def decode(cls, token: str) -> Continuation:
        try:
            raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
            index, pin, ours, entry, descending = json.loads(raw)
            return cls(str(index), str(pin), bool(ours), bytes.fromhex(entry), bool(descending))
        except (ValueError, TypeError):
            raise ApiError(400, "next: not a token a page gave") from None


def _continuation(query: dict[str, str], index: str) -> Continuation:
    """The `next` parameter, checked: the pages' snapshot and order are the token's."""
    taken = [p for p in ("pin", "consistency", "at_plus", "timeout", "offset") if p in query]
    if taken:
        raise ApiError(
            400, f"{', '.join(taken)}: not taken with next, which reads on where the page ended"
        )
    continued = Continuation.decode(query["next"])
    if continued.index != index:
        raise ApiError(400, f"next: a token of index {continued.index!r}, not {index!r}")
    if "order" in query and (query["order"] == "desc") != continued.descending:
        raise ApiError(400, "order: the pages keep the order of the first")
    return continued


async def _stream(
    send: Send, content_type: str, meta: dict[str, str], next_body: Callable[[], bytes | None]
) -> None:
    """Answer 200 with the bodies `next_body` gives until it gives None. It runs in a worker
    thread: decoding and encoding stay off the event loop."""
    await _start(send, 200, content_type, meta)
    while True:
        body: bytes | None = await trio.to_thread.run_sync(next_body)
        if body is None:
            break
        await send({"type": "http.response.body", "body": body, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _arrow_bodies(schema: pa.Schema, write: Callable[[Any], bool]) -> Callable[[], bytes | None]:
    """The bodies of an Arrow IPC stream: what each call of `write` (a record batch, or False
    at the end) adds to it, then its end."""
    sink = _Chunks()
    writer = pa.ipc.new_stream(sink, schema)
    ended = False

    def next_body() -> bytes | None:
        nonlocal ended
        if ended:
            return None
        if not write(writer):
            writer.close()
            ended = True
        return sink.take()

    return next_body


def _snapshot_metadata(snap: StabilitySnapshot) -> dict[str, str]:
    """The Arrow schema metadata naming the snapshot a stream read."""
    return {"indexer.snapshot": str(snap.number), "indexer.seqno_sum": str(snap.timestamp.total)}


GROUPS_PER_CHUNK = 1024  # groups of an aggregate answer encoded per worker-thread call


def group_lines(groups: Iterator[dict[str, Any]]) -> bytes | None:
    """The next groups as NDJSON lines; None at the end."""
    chunk = list(islice(groups, GROUPS_PER_CHUNK))
    if not chunk:
        return None
    return "".join(json_encode(g) + "\n" for g in chunk).encode()


def group_schema(
    paths: Sequence[str], aggregates: Sequence[Aggregate], snap: StabilitySnapshot
) -> pa.Schema:
    """An aggregate answer's Arrow columns: the group's keys as JSON text, counts as int64,
    sums and averages as float64, minimums and maximums as JSON text."""
    kinds = {"count": pa.int64(), "count_distinct": pa.int64(), "sum": pa.float64()}
    kinds["avg"] = pa.float64()
    fields = [pa.field(p, pa.string()) for p in paths]
    fields += [pa.field(a.name, kinds.get(a.function, pa.string())) for a in aggregates]
    return pa.schema(fields, metadata=_snapshot_metadata(snap))


def group_batch(
    groups: Iterator[dict[str, Any]], writer: Any, schema: pa.Schema, width: int
) -> bool:
    """Write the next groups (of `width` keys) as one record batch; False at the end."""
    chunk = list(islice(groups, GROUPS_PER_CHUNK))
    if not chunk:
        return False
    columns = []
    for j, field in enumerate(schema):
        if j < width:
            texts = [
                None if j in g.get("missing", ()) else json_encode(g["group"][j]) for g in chunk
            ]
            columns.append(pa.array(texts, pa.string()))
        elif pa.types.is_string(field.type):
            values = [g[field.name] for g in chunk]
            columns.append(pa.array([None if v is None else json_encode(v) for v in values]))
        else:
            columns.append(pa.array([g[field.name] for g in chunk], field.type))
    writer.write_batch(pa.RecordBatch.from_arrays(columns, schema=schema))
    return True


def _span_range(definition: IndexDefinition, span: dict[str, Any]) -> KeyRange:
    """The bounds of one span: an equality or a range on the key or a prefix of it, or the
    strings of the leading key that start with `prefix`."""
    if "prefix" in span:
        if set(span) & {"eq", "low", "high", "inclusion"}:
            raise ApiError(400, "prefix: give it alone, not with eq, low, high or inclusion")
        return string_prefix_range(span["prefix"], definition.desc[0])
    return key_range(
        len(definition.keys),
        desc=definition.desc,
        eq=span.get("eq"),
        low=span.get("low"),
        high=span.get("high"),
        inclusion=span.get("inclusion", "both"),
        has_eq="eq" in span,
        has_low="low" in span,
        has_high="high" in span,
    )


def _descending(query: dict[str, str]) -> bool:
    """The `order` parameter of a scan: asc (index order, the default) or desc."""
    order = query.get("order", "asc")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order: asc or desc, not {order!r}")
    return order == "desc"


def serving_cores() -> int:
    """The cores this process may run on (its CPU affinity where the system says)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def held_ranges(snap: StabilitySnapshot, only: VbucketFilter | None = None) -> list[str]:
    """The vbuckets whose documents the snapshot holds (of `only`'s: those an answer
    holds), as "first-last" ranges."""
    held = (
        range(len(snap.timestamp.seqnos))
        if not snap.held
        else [vb for vb, flag in enumerate(snap.held) if flag]
    )
    if only is not None:
        held = [vb for vb in held if vb in only.vbuckets]
    return vbucket_ranges(held) if held else []


def vbucket_filter(query: dict[str, str], num: int) -> VbucketFilter | None:
    """The `vbuckets` parameter ("0-511,700"): answer only for documents of those vbuckets."""
    text = query.get("vbuckets")
    if text is None:
        return None
    try:
        chosen = parse_vbuckets(text.split(",") if text else [], num, "vbuckets")
    except ClusterMapError as exc:
        raise ApiError(400, str(exc)) from None
    return VbucketFilter(frozenset(chosen), num)


def snapshot_filter(snap: StabilitySnapshot, only: VbucketFilter | None) -> VbucketFilter | None:
    """The vbuckets an answer of `snap` may hold: `only`'s, less any the node was deleting
    when the snapshot was made (their documents part gone, part still in the store)."""
    if not snap.leaving:
        return only
    num = len(snap.timestamp.seqnos)
    chosen = frozenset(range(num)) if only is None else only.vbuckets
    return VbucketFilter(chosen - snap.leaving, num)


class ScanRoutes(AdminRoutes):
    """Reads: scans and counts of a snapshot at a consistency, splits, and pinned snapshots."""

    @contextmanager
    def _scan_slot(self) -> Iterator[None]:
        """One of `limits.max_concurrent_scans` places, or 429 when all are taken."""
        most = self.limits.max_concurrent_scans
        if self.scans_in_flight >= most:
            self.refused["too_many_scans"] += 1
            log.warning("scan refused: %d scans running (limits.max_concurrent_scans)", most)
            raise ApiError(
                429,
                f"{most} scans are running, the most this daemon serves at once "
                "(limits.max_concurrent_scans): retry shortly",
                {RETRY_AFTER: "1"},
            )
        self.scans_in_flight += 1
        try:
            yield
        finally:
            self.scans_in_flight -= 1

    def _describe(self, snap: StabilitySnapshot) -> dict[str, Any]:
        return {
            "snapshot": snap.number,
            "seqno_sum": snap.timestamp.total,
            "created_at": snap.created_at,
            "seqnos": list(snap.timestamp.seqnos),
            "vbuuids": list(snap.timestamp.vbuuids),
            "vbuckets": held_ranges(snap),
        }

    def snapshot_list(self) -> dict[str, Any]:
        snaps = self.view.snapshots
        return {
            "stable": self._describe(snaps.stable) if snaps.stable else None,
            "persisted": self._describe(snaps.persisted_snapshot)
            if snaps.persisted_snapshot
            else None,
            "pinned": [
                {
                    "id": p.pin_id,
                    "snapshot": p.snapshot.number,
                    "seqno_sum": p.snapshot.timestamp.total,
                    "lease_s": p.lease_s,
                    "expires_in_s": round(p.expires_at - time.monotonic(), 3),
                }
                for p in snaps.pins.values()
            ],
        }

    def _target(self, consistency: str, at_plus: Any) -> list[tuple[int, int]] | None:
        """The (vbucket, seqno) pairs a snapshot must cover, or None for `any`."""
        if consistency not in CONSISTENCIES:
            raise ApiError(400, f"consistency: one of {', '.join(CONSISTENCIES)}")
        if consistency == "any":
            return None
        if consistency == "request_plus":
            return list(enumerate(self.view.registry.received))
        return _vector(at_plus, len(self.view.registry.received))

    async def _snapshot_for(
        self, consistency: str, at_plus: Any, timeout_s: float
    ) -> StabilitySnapshot:
        target = self._target(consistency, at_plus)
        snaps = self.view.snapshots
        if target is None:
            if snaps.stable is None:
                raise ApiError(503, "no readable snapshot yet", {RETRY_AFTER: "1"})
            return snaps.stable
        with trio.move_on_after(timeout_s):
            try:
                return await snaps.wait_covering(target)
            except RolledBackError as exc:
                raise ApiError(409, str(exc)) from None
        raise ApiError(
            504, f"timed out after {timeout_s:g} s waiting for a snapshot at {consistency}"
        )

    async def pin(self, body: dict[str, Any], send: Send) -> None:
        lease = _number(body.get("lease_s", DEFAULT_LEASE_S), "lease_s", 1, MAX_LEASE_S)
        timeout = _number(body.get("timeout_s", DEFAULT_TIMEOUT_S), "timeout_s", 0, 3600)
        which = body.get("snapshot", "persisted")
        snaps = self.view.snapshots
        if "at_plus" in body:
            snap = await self._snapshot_for("at_plus", body["at_plus"], timeout)
        elif which == "persisted":
            if snaps.persisted_snapshot is None:
                raise ApiError(503, "no persisted snapshot yet", {RETRY_AFTER: "1"})
            snap = snaps.persisted_snapshot
        elif which == "stable":
            snap = await self._snapshot_for("any", None, timeout)
        else:
            raise ApiError(400, 'snapshot: "persisted" or "stable" (or give "at_plus")')
        pin = snaps.pin(snap, lease)
        log.info("snapshot %d pinned as %s for %g s", snap.number, pin.pin_id, lease)
        answer = {"id": pin.pin_id, "lease_s": lease, **self._describe(snap)}
        # The cores this process may run on: a reader sizes its parallel scans by them.
        answer["scan_cores"] = serving_cores()
        await _json(send, 200, answer)

    def _range(self, index: StoredIndex, query: dict[str, str]) -> Bounds:
        if "spans" in query:
            return self._spans(index, query)
        span: dict[str, Any] = {
            name: parse_json_param(name, query[name])
            for name in ("eq", "low", "high")
            if name in query
        }
        if "prefix" in query:
            span["prefix"] = query["prefix"]
        if "inclusion" in query:
            span["inclusion"] = query["inclusion"]
        bounds = _span_range(index.definition, span)
        start = _hex(query, "start")
        stop = _hex(query, "stop")
        lo = max((b for b in (bounds.start, start) if b is not None), default=None)
        hi = min((b for b in (bounds.stop, stop) if b is not None), default=None)
        return KeyRange(lo, hi)

    def _spans(self, index: StoredIndex, query: dict[str, str]) -> tuple[KeyRange, ...]:
        """`spans=[{"eq": V} or {"low": V, "high": V, "inclusion": ...}, ...]`: several ranges
        in one scan, read in index order, an entry in several of them once."""
        clash = [
            p for p in ("eq", "low", "high", "inclusion", "prefix", "start", "stop") if p in query
        ]
        if clash:
            raise ApiError(400, f"{', '.join(clash)}: give the range in spans, or no spans")
        spans = parse_json_param("spans", query["spans"])
        if not isinstance(spans, list) or not spans or len(spans) > MAX_SPANS:
            raise ApiError(400, f"spans: a list of 1 to {MAX_SPANS} spans")
        ranges = []
        for span in spans:
            if not isinstance(span, dict) or not set(span) <= {
                "eq",
                "low",
                "high",
                "inclusion",
                "prefix",
            }:
                raise ApiError(
                    400,
                    'spans: each one {"eq": V}, {"low": V, "high": V, "inclusion": ...} '
                    'or {"prefix": "S"}',
                )
            ranges.append(_span_range(index.definition, span))
        return merge_spans(ranges)

    async def _read_snapshot(self, query: dict[str, str]) -> StabilitySnapshot:
        """The snapshot a read asks for: its pin's, or one at its consistency. `at_plus` alone
        implies consistency=at_plus; a parameter the choice would ignore is a 400. A node
        fenced in its cluster (indexer/cluster/standing.py) answers 503."""
        standing = self.view.standing
        fenced = None if standing is None else standing.fenced()
        if fenced is not None:
            raise ApiError(503, fenced, {RETRY_AFTER: "1"})
        if "pin" in query:
            ignored = [p for p in ("consistency", "at_plus", "timeout") if p in query]
            if ignored:
                raise ApiError(
                    400,
                    f"{', '.join(ignored)}: not taken with pin, which reads the pinned snapshot "
                    "as it is",
                )
            pin = self.view.snapshots.pins.get(query["pin"])
            if pin is None:
                raise ApiError(404, f"no pin {query['pin']!r} (released or expired)")
            return pin.snapshot
        timeout = _number(query.get("timeout", DEFAULT_TIMEOUT_S), "timeout", 0, 3600)
        at_plus = parse_json_param("at_plus", query["at_plus"]) if "at_plus" in query else None
        consistency = query.get("consistency", "at_plus" if "at_plus" in query else "any")
        if consistency == "at_plus" and at_plus is None:
            raise ApiError(400, "consistency=at_plus needs at_plus={vbucket: seqno, ...}")
        if at_plus is not None and consistency != "at_plus":
            raise ApiError(
                400,
                f"at_plus is given with consistency={consistency}, which would ignore it: give "
                "at_plus alone (or with consistency=at_plus) to wait for that vector",
            )
        return await self._snapshot_for(consistency, at_plus, timeout)

    async def scan(
        self,
        index: StoredIndex,
        query: dict[str, str],
        headers: dict[str, str],
        send: Send,
        count_only: bool,
    ) -> int:
        """Answer a scan (or with `count_only` a count); the rows it returned."""
        if self.view.throttle.paused:
            raise ApiError(503, "the daemon is short of memory; retry later", {RETRY_AFTER: "2"})
        limit = None
        if "limit" in query:
            limit = int(_number(query["limit"], "limit", 0, 2**62))
            if str(limit) != query["limit"].strip():
                raise ApiError(400, "limit: a whole number")
        most = self.limits.max_scan_rows
        if most and not count_only and limit is not None and limit > most:
            self._too_many_rows(f"limit={limit} is over the {most} rows")
        bounds = self._range(index, query)
        only = vbucket_filter(query, len(self.view.registry.owned))
        descending = _descending(query)
        offset = 0
        if "offset" in query:
            offset = int(_number(query["offset"], "offset", 0, 2**62))
        continued = None
        if "next" in query and not count_only:
            continued = _continuation(query, index.definition.name)
            descending = continued.descending
            bounds = after(bounds, continued.after, descending)
            pinned = self.view.snapshots.pins.get(continued.pin)
            if pinned is None:
                raise ApiError(
                    404,
                    "the snapshot of these pages is no longer pinned (a page came more than "
                    f"{PAGE_LEASE_S:g} s after the one before): scan again from the start",
                )
            if continued.ours:
                self.view.snapshots.renew(continued.pin, PAGE_LEASE_S)
            found = pinned.snapshot
        else:
            found = await self._read_snapshot(query)
        snap = found.acquire()
        try:
            if not snap.is_open:
                raise ApiError(410, "the snapshot was released")
            only = snapshot_filter(snap, only)
            if most and not count_only and limit is None:
                await self._check_rows(index, snap, bounds, most, only)
            meta = {
                SNAPSHOT_HEADER: str(snap.number),
                SEQNO_SUM_HEADER: str(snap.timestamp.total),
            }
            if snap.held:  # what a merged scan checks against the map it read
                meta[VBUCKETS_HEADER] = ",".join(held_ranges(snap, only))
            standing = self.view.standing
            if standing is not None and standing.active is not None:
                meta[ACTIVE_HEADER] = ",".join(vbucket_ranges(sorted(standing.active)))
            if count_only:
                n = snap.entry_counts.get(index.definition.name)
                if n is None or bounds != KeyRange() or only is not None:
                    n = await trio.to_thread.run_sync(
                        count_entries, self.view.store, index, snap.store_snapshot, bounds, only
                    )
                await _json(send, 200, {"count": n, "snapshot": snap.number}, meta)
                return 0
            if limit is not None:  # a page: read whole first, so its last entry makes `next`
                entries = await trio.to_thread.run_sync(
                    page, self.view.store, index, snap.store_snapshot, bounds, offset, limit,
                    descending, only,
                )  # fmt: skip
                if limit and len(entries) == limit:
                    meta[NEXT_HEADER] = self._next_token(
                        index, snap, query, continued, entries[-1], descending
                    )
                batches = page_batches(index, entries, SCAN_CHUNK)
            else:
                batches = entry_batches(
                    self.view.store, index, snap.store_snapshot, bounds, None, SCAN_CHUNK,
                    reverse=descending, offset=offset, only=only,
                )  # fmt: skip
            chunks = _RowCount(batches)
            self.active_scans += 1
            try:
                if ARROW in headers.get("accept", ""):
                    await self._stream_arrow(index, snap, chunks, send, meta, query)
                else:
                    if "columns" in query:
                        raise ApiError(400, "columns: for Arrow scans (Accept: " + ARROW + ")")
                    projection = _projection(query, index.definition.keys)
                    await self._stream_ndjson(chunks, send, meta, projection)
            finally:
                self.active_scans -= 1
            return chunks.rows
        finally:
            snap.release()

    async def _check_rows(
        self,
        index: StoredIndex,
        snap: StabilitySnapshot,
        bounds: Bounds,
        most: int,
        only: VbucketFilter | None = None,
    ) -> None:
        """413 before any row is sent when a scan without a limit would pass `most` rows:
        counted on the snapshot it reads, up to most + 1 entries (none when the whole index
        is small enough)."""
        total = snap.entry_counts.get(index.definition.name)
        if total is not None and total <= most:
            return
        over = await trio.to_thread.run_sync(
            more_than, self.view.store, index, snap.store_snapshot, bounds, most, only
        )
        if over:
            self._too_many_rows(f"the range holds more than the {most} rows")

    def _too_many_rows(self, what: str) -> None:
        self.refused["too_many_rows"] += 1
        raise ApiError(
            413,
            f"{what} a scan may return (limits.max_scan_rows): give a limit of at most "
            "that, or narrow the range (low/high, or start/stop as /splits gives them)",
        )

    async def _stream_ndjson(
        self,
        chunks: Iterator[EntryBatch],
        send: Send,
        meta: dict[str, str],
        projection: Projection,
    ) -> None:
        await _stream(send, NDJSON, meta, functools.partial(_ndjson_chunk, chunks, projection))

    async def _stream_arrow(
        self,
        index: StoredIndex,
        snap: StabilitySnapshot,
        chunks: Iterator[EntryBatch],
        send: Send,
        meta: dict[str, str],
        query: dict[str, str],
    ) -> None:
        paths = index.definition.keys
        kinds = _column_kinds(query.get("columns"), len(paths))
        projection = _projection(query, paths)
        fields = [pa.field(paths[j], COLUMN_KINDS[kinds[j]]) for j in projection.positions]
        if projection.with_id:
            fields.insert(projection.id_at, pa.field("id", pa.string()))
        if projection.collation:  # where a reader that resumes the scan elsewhere stopped
            fields.append(pa.field("collation", pa.binary()))
        schema = pa.schema(fields, metadata=_snapshot_metadata(snap))

        def write(writer: Any) -> bool:
            return _arrow_chunk(chunks, writer, schema, kinds, projection)

        await _stream(send, ARROW, meta, _arrow_bodies(schema, write))

    def _next_token(
        self,
        index: StoredIndex,
        snap: StabilitySnapshot,
        query: dict[str, str],
        continued: Continuation | None,
        last: bytes,
        descending: bool,
    ) -> str:
        """The continuation of a full page: the pin of its snapshot (the request's, or one made
        here under a short lease, renewed by every page) and the last entry read."""
        if continued is not None:
            pin_id, ours = continued.pin, continued.ours
        elif "pin" in query:
            pin_id, ours = query["pin"], False
        else:
            pin_id, ours = self.view.snapshots.pin(snap, PAGE_LEASE_S).pin_id, True
        entry = last[len(index.main_prefix) :]
        return Continuation(index.definition.name, pin_id, ours, entry, descending).encode()

    async def aggregate(
        self, index: StoredIndex, query: dict[str, str], headers: dict[str, str], send: Send
    ) -> None:
        """GET /indexes/NAME/aggregate: per group of the first `group_by` keys, in index order,
        the `aggregates` asked for, over a scan's range and snapshot; NDJSON or Arrow."""
        paths = index.definition.keys
        group_by = int(_number(query.get("group_by", "0"), "group_by", 0, len(paths)))
        try:
            aggregates = parse_aggregates(query.get("aggregates", "count"), paths)
        except AggregateError as exc:
            raise ApiError(400, str(exc)) from None
        bounds = self._range(index, query)
        snap = (await self._read_snapshot(query)).acquire()
        try:
            meta = {SNAPSHOT_HEADER: str(snap.number), SEQNO_SUM_HEADER: str(snap.timestamp.total)}
            batches = entry_batches(
                self.view.store,
                index,
                snap.store_snapshot,
                bounds,
                None,
                SCAN_CHUNK,
                docids=False,
                decode=decoded_values(group_by, aggregates),
                only=snapshot_filter(snap, vbucket_filter(query, len(self.view.registry.owned))),
            )
            groups = aggregate(batches, group_by, aggregates)
            if ARROW in headers.get("accept", ""):
                schema = group_schema(paths[:group_by], aggregates, snap)

                def write(writer: Any) -> bool:
                    return group_batch(groups, writer, schema, group_by)

                await _stream(send, ARROW, meta, _arrow_bodies(schema, write))
            else:
                await _stream(send, NDJSON, meta, functools.partial(group_lines, groups))
        finally:
            snap.release()

    async def lookup(
        self, index: StoredIndex, docid: str, query: dict[str, str], send: Send
    ) -> None:
        """GET /indexes/NAME/docs/ID: the document's entries in the index at the snapshot, read
        from the back index (none: it is not in the index there)."""
        if not docid or len(docid.encode()) > 250:
            raise ApiError(400, "the document id must be 1 to 250 bytes")
        snap = (await self._read_snapshot(query)).acquire()
        try:
            rows = await trio.to_thread.run_sync(
                lookup, self.view.store, index, snap.store_snapshot, docid
            )
        finally:
            snap.release()
        meta = {SNAPSHOT_HEADER: str(snap.number), SEQNO_SUM_HEADER: str(snap.timestamp.total)}
        answer = {"id": docid, "entries": [r.as_json() for r in rows], "snapshot": snap.number}
        await _json(send, 200, answer, meta)

    async def types(self, index: StoredIndex, query: dict[str, str], send: Send) -> None:
        """The JSON types each key position holds at the snapshot, and the column kind a typed
        read gives it. One walk over the index per snapshot; the answers of the last few
        snapshots are kept."""
        snap = (await self._read_snapshot(query)).acquire()
        try:
            key = (index.definition.name, snap.number)
            found = self.types_cache.get(key)
            if found is None:
                found = await trio.to_thread.run_sync(
                    key_types, self.view.store, index, snap.store_snapshot
                )
                self.types_cache[key] = found
                while len(self.types_cache) > TYPES_CACHE:
                    self.types_cache.pop(next(iter(self.types_cache)))
        finally:
            snap.release()
        answer = {
            "types": [sorted(t) for t in found],
            "columns": [column_kind(t) for t in found],
            "snapshot": snap.number,
        }
        await _json(send, 200, answer)

    async def split(self, index: StoredIndex, query: dict[str, str], send: Send) -> None:
        parts = int(_number(query.get("parts", "4"), "parts", 1, 10_000))
        snap = (await self._read_snapshot(query)).acquire()
        try:
            total = snap.entry_counts.get(index.definition.name)  # None: walk to count
            ranges = await trio.to_thread.run_sync(
                splits, self.view.store, index, snap.store_snapshot, parts, total
            )
        finally:
            snap.release()
        out = [
            {"start": r.start.hex() if r.start else None, "stop": r.stop.hex() if r.stop else None}
            for r in ranges
        ]
        await _json(send, 200, {"splits": out, "snapshot": snap.number})

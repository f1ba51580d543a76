"""The admin and scan HTTP API: a small ASGI app served by hypercorn inside the daemon's trio run.

Routes (JSON unless said otherwise; errors are `{"error": message}` with a 4xx/5xx status):

    GET    /health                   200 once the daemon is ready (HEAD: the same, no body)
    GET    /stats                    uptime, version, HWT summary, snapshots, queues, slab,
                                     throttle, per index entries, bytes on disk and scans
    GET    /metrics                  Prometheus text format (below)
    GET    /indexes                  index definitions, states and entry counts
    GET    /indexes/NAME             one index: its entry of /indexes and of /stats' indexes
    GET    /indexes/NAME/scan        NDJSON rows, or Arrow IPC when asked (Accept: ARROW below)
    GET    /indexes/NAME/count       {"count": N}
    GET    /indexes/NAME/splits      key ranges of about equal size, for parallel readers
    GET    /snapshots                the latest readable, the persisted and the pinned snapshots
    POST   /snapshots/pin            pin a snapshot under a lease -> {"id": ...}
    POST   /snapshots/ID/renew       extend a pin's lease
    DELETE /snapshots/ID             release a pin

    POST   /indexes                  create an index (a build over existing data)
    DELETE /indexes/NAME             drop an index
    POST   /compact                  compact the store now

Every scan answer names the snapshot it read: headers `X-Indexer-Snapshot` (its number) and
`X-Indexer-Seqno-Sum`, and for Arrow the same in the stream's schema metadata.

Query parameters: /scan takes eq, low, high, inclusion, start, stop, limit, consistency, at_plus,
timeout and pin; /count the same but limit; /splits parts, consistency, at_plus, timeout and pin;
every other route none. Any other parameter, or one given twice, is a 400 naming it. `at_plus`
alone implies consistency=at_plus (with another consistency it is a 400); a `pin` reads its
pinned snapshot, so it takes no consistency, at_plus or timeout.

/stats adds to the stages' statistics `uptime_s` (since the process started), `version`,
`scans_in_flight` (scan, count and split requests being served now, at most
limits.max_concurrent_scans), `scans_active` (of those, the ones streaming rows now),
`scans_served` (scan and count requests answered since start) and per index under `indexes`:
`entries`; `bytes_on_disk`, LevelDB's estimate of what its main and back entries take in the
table files (what is only in the write-ahead log and memtable yet, a few MiB, is not counted);
`scans`, the scan and count requests answered; `rows`, the rows scans returned; and
`scan_latency_s`, their latency from the index's lookup to the last byte: count, mean, p50 and
p99 (estimated from the histogram's buckets) and max.

/metrics: counters are Prometheus counters, exposed with `_total`; histograms have `_bucket`,
`_sum` and `_count`.

    indexer_build_info{version}                    1, with the package's version
    indexer_mutations_received_total               mutations received from routers
    indexer_mutations_flushed_total                mutations written to the store
    indexer_protocol_errors_total                  connections refused for protocol errors
    indexer_throttle_pauses_total                  times reads were paused for memory
    indexer_store_write_errors_total               failed store writes (each retried)
    indexer_persist_errors_total                   failed persists (each retried)
    indexer_http_refused_total{reason}             unauthorized, too_many_scans, too_many_rows
    indexer_gc_collections_total{generation}       cycle collections
    indexer_scans_total{index}                     scan and count requests answered
    indexer_scan_rows_total{index}                 rows scans returned
    indexer_scan_duration_seconds{index}           histogram: latency of those requests
    indexer_flush_duration_seconds                 histogram: a flush of every worker
    indexer_persist_lag_seconds                    histogram: a snapshot's age when persisted
    indexer_index_entries{index}                   gauge: entries per active index
    indexer_index_bytes_on_disk{index}             gauge: the estimate of /stats
    indexer_build_progress_ratio{index}            gauge: 0 to 1, per index being built
    indexer_persist_failing                        gauge: 1 while persists fail
    indexer_disk_full                              gauge: 1 while a store write or persist
                                                   fails for lack of space
    indexer_scans_in_flight                        gauge: as in /stats
    indexer_router_connections, indexer_queued_mutations{worker}, indexer_rss_bytes,
    indexer_slab_chunk_bytes_in_use, indexer_slab_total_bytes, indexer_throttle_paused,
    indexer_stable_seqno_sum, indexer_persisted_seqno_sum, indexer_snapshot_pins,
    indexer_gc_pause_longest_seconds{generation}   gauges
    process_*                                      the process's CPU, memory, files, start time

With `[security] token`, every call but GETs needs `Authorization: Bearer TOKEN` (GETs too with
`scan_token_required`, but /health): otherwise 401 with `WWW-Authenticate`. `[limits]` bounds
the scans served at once (429) and the rows of one scan (413). See docs/security.md.
"""

from __future__ import annotations

import io
import json
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import parse_qsl

import pyarrow as pa
import trio
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from indexer.asgi import answer_lifespan
from indexer.build import IndexBuild
from indexer.catalog import CatalogError, IndexCatalog
from indexer.client import (
    ARROW_STREAM,
    AUTHORIZATION,
    JSON,
    NDJSON,
    RETRY_AFTER,
    SEQNO_SUM_HEADER,
    SNAPSHOT_HEADER,
)
from indexer.collector import CollectorPauses
from indexer.compaction import Compactor
from indexer.config import (
    FIELD_PATH,
    INDEX_NAME,
    MAX_KEYS,
    LimitsConfig,
    SecurityConfig,
    check_index_name,
)
from indexer.metrics import (
    SCAN_BUCKETS_S,
    Histogram,
    build_info,
    collector_metrics,
    counter,
    gauge,
    histogram_family,
    process_started_at,
    version,
)
from indexer.pipeline import Pipeline
from indexer.protocol import IndexDefinition, bearer_refusal
from indexer.scans import (
    EntryBatch,
    KeyRange,
    Row,
    ScanRequestError,
    count_entries,
    entry_batches,
    json_encode,
    json_text,
    key_range,
    more_than,
    parse_json_param,
    splits,
)
from indexer.snapshots import RolledBackError, SnapshotStore, StabilitySnapshot
from indexer.storage import IndexStore, StoredIndex
from indexer.streams import StreamRegistry
from indexer.timekeeper import Timekeeper
from indexer.timestamps import HighWaterTimestamp
from indexer.where import WhereError, normalize_where
from slab import MemoryThrottle, SlabPool
from workers.worker import Worker

log = logging.getLogger("indexer.http")

ARROW = ARROW_STREAM  # the media types and header names are the clients' too
SCAN_CHUNK = 8192
DEFAULT_TIMEOUT_S = 120.0
DEFAULT_LEASE_S = 600.0
MAX_LEASE_S = 86400.0
CONSISTENCIES = ("any", "request_plus", "at_plus")
INDEX_ACTIONS = ("scan", "count", "splits")
READ_METHODS = ("GET", "HEAD")
# The query parameters each route takes; any other is a 400 (ROUTE_PARAMS: none).
SNAPSHOT_PARAMS = ("consistency", "at_plus", "timeout", "pin")
COUNT_PARAMS = ("eq", "low", "high", "inclusion", "start", "stop", *SNAPSHOT_PARAMS)
ACTION_PARAMS = {
    "scan": (*COUNT_PARAMS, "limit"),
    "count": COUNT_PARAMS,
    "splits": ("parts", *SNAPSHOT_PARAMS),
}
ROUTE_PARAMS: tuple[str, ...] = ()
ROUTES = ("/health", "/stats", "/metrics", "/indexes", "/compact", "/snapshots", "/snapshots/pin")
NO_SPACE = "No space left on device"  # in what a write to a full disk raises
PIN_ROUTE = re.compile(r"^/snapshots/(p\d+)(/renew)?$")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class ApiError(Exception):
    """An answer other than success: HTTP status, message, extra headers."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


@dataclass
class DaemonView:
    """The parts of the running daemon the API reads; it changes nothing but pins."""

    pipeline: Pipeline
    hwt: HighWaterTimestamp
    pool: SlabPool
    throttle: MemoryThrottle
    in_memory_interval_s: float
    catalog: IndexCatalog | None = None
    compactor: Compactor | None = None
    collector: CollectorPauses | None = None
    ready: bool = False

    @property
    def store(self) -> IndexStore:
        return self.pipeline.store

    @property
    def indexes(self) -> list[StoredIndex]:
        return self.pipeline.indexes

    @property
    def snapshots(self) -> SnapshotStore:
        return self.pipeline.snapshots

    @property
    def registry(self) -> StreamRegistry:
        return self.pipeline.registry

    @property
    def workers(self) -> list[Worker]:
        return self.pipeline.workers

    @property
    def timekeeper(self) -> Timekeeper:
        return self.pipeline.timekeeper


@dataclass
class IndexReads:
    """The scan and count requests one index answered: /stats' and /metrics' per-index view."""

    scans: int = 0
    rows: int = 0
    latency: Histogram = field(default_factory=lambda: Histogram(SCAN_BUCKETS_S))


class HttpApi:
    """The ASGI application."""

    def __init__(
        self,
        view: DaemonView,
        security: SecurityConfig | None = None,
        limits: LimitsConfig | None = None,
    ) -> None:
        self.view = view
        self.security = security or SecurityConfig()
        self.limits = limits or LimitsConfig()
        # The app's own registry: two apps in one process (the tests) never share metrics.
        self.metrics = CollectorRegistry()
        self.metrics.register(_Collector(self))
        ProcessCollector(registry=self.metrics)
        self.started_at = process_started_at()
        self.version = version()
        self.active_scans = 0  # streaming rows now
        self.scans_in_flight = 0  # scan, count and split requests being served now
        self.scans_served = 0  # scan and count requests answered since start
        self.reads: dict[str, IndexReads] = {}  # by index name
        self.bytes_on_disk: dict[str, int] = {}  # by index name, as last measured
        self.refused = {"unauthorized": 0, "too_many_scans": 0, "too_many_rows": 0}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if scope["method"] == "HEAD":
            send = _headers_only(send)
        try:
            await self._route(scope, receive, send)
        except ApiError as exc:
            await _json(send, exc.status, {"error": exc.message}, exc.headers)
        except ScanRequestError as exc:
            await _json(send, 400, {"error": str(exc)})
        except Exception as exc:  # a bug must cost one request, never the daemon
            log.exception("%s %s failed", scope["method"], scope["path"])
            await _json(send, 500, {"error": f"internal error: {type(exc).__name__}"})

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope["method"]
        path = scope["path"].rstrip("/") or "/"
        query = _query(scope["query_string"])
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        self._authorize(scope, method, path, headers)
        if path in ROUTES or PIN_ROUTE.match(path):  # /indexes/NAME... checks its own
            _params(query, ROUTE_PARAMS, path)
        if path == "/health":
            _only(method, "GET", "HEAD")
            if not self.view.ready:
                raise ApiError(503, "starting", {RETRY_AFTER: "1"})
            await _json(send, 200, {"status": "ok"})
        elif path == "/stats":
            _only(method, "GET")
            await self.measure_disk()
            await _json(send, 200, self.stats())
        elif path == "/metrics":
            _only(method, "GET")
            await self.measure_disk()
            body = generate_latest(self.metrics)
            await _respond(send, 200, body, "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/indexes":
            if method == "POST":
                await self.create_index(await _body_json(receive), send)
                return
            _only(method, "GET")
            await _json(send, 200, {"indexes": self.index_list()})
        elif path.startswith("/indexes/"):
            await self._index_route(method, path, query, headers, send)
        elif path == "/compact":
            _only(method, "POST")
            if self.view.compactor is None:
                raise ApiError(503, "compaction is not available")
            result = await self.view.compactor.compact()
            await _json(send, 200, result.as_dict())
        elif path == "/snapshots":
            _only(method, "GET")
            await _json(send, 200, self.snapshot_list())
        elif path == "/snapshots/pin":
            _only(method, "POST")
            await self.pin(await _body_json(receive), send)
        elif match := PIN_ROUTE.match(path):
            pin_id = match.group(1)
            if match.group(2):  # POST /snapshots/ID/renew {"lease_s": ...}
                _only(method, "POST")
                request = await _body_json(receive)
                lease = _number(request.get("lease_s", DEFAULT_LEASE_S), "lease_s", 1, MAX_LEASE_S)
                if self.view.snapshots.renew(pin_id, lease) is None:
                    raise ApiError(404, f"no pin {pin_id!r} (released or expired)")
                await _json(send, 200, {"id": pin_id, "lease_s": lease})
                return
            _only(method, "DELETE")
            if not self.view.snapshots.unpin(pin_id):
                raise ApiError(404, f"no pin {pin_id!r} (released or expired)")
            await _respond(send, 204, b"", "text/plain")
        else:
            raise ApiError(404, f"no such route: {path}")

    async def _index_route(
        self, method: str, path: str, query: dict[str, str], headers: dict[str, str], send: Send
    ) -> None:
        """GET and DELETE /indexes/NAME and GET /indexes/NAME/(scan|count|splits); a name that
        is not an index name is a 400, whatever follows it."""
        name, _, action = path[len("/indexes/") :].partition("/")
        problem = check_index_name(name)
        if problem is not None:
            raise ApiError(400, problem)
        if not action:
            _only(method, "GET", "DELETE")
            _params(query, ROUTE_PARAMS, path)
            if method == "GET":
                await _json(send, 200, await self.index_details(name))
                return
            await self._catalog_call(self._catalog().drop(name))
            await _respond(send, 204, b"", "text/plain")
            return
        if action not in INDEX_ACTIONS:
            raise ApiError(404, f"no such route: {path} (an index has /scan, /count, /splits)")
        _only(method, "GET")
        _params(query, ACTION_PARAMS[action], f"/indexes/NAME/{action}")
        with self._scan_slot():
            index = self._index(name, query)
            if action == "splits":
                await self.split(index, query, send)
                return
            started = time.perf_counter()
            rows = await self.scan(index, query, headers, send, count_only=action == "count")
            self._served(name, rows, time.perf_counter() - started)

    def _served(self, name: str, rows: int, seconds: float) -> None:
        """Count a scan or count request answered: its rows and how long it took."""
        reads = self.reads.setdefault(name, IndexReads())
        reads.scans += 1
        reads.rows += rows
        reads.latency.observe(seconds)
        self.scans_served += 1

    # ---------------------------------------------------------------------------- security

    def _authorize(self, scope: Scope, method: str, path: str, headers: dict[str, str]) -> None:
        """Refuse (401) a call that needs the token and lacks it; log why, never the token."""
        token = self.security.token
        if token is None or path == "/health":
            return
        if method in READ_METHODS and not self.security.scan_token_required:
            return
        refusal = bearer_refusal(headers.get(AUTHORIZATION, ""), token)
        if refusal is None:
            return
        reason, error = refusal
        self.refused["unauthorized"] += 1
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "unknown"
        log.warning("HTTP %s %r from %s refused: %s", method, path, who, reason)
        challenge = 'Bearer realm="indexer"' + (f', error="{error}"' if error else "")
        raise ApiError(
            401,
            f"{reason}: this call needs Authorization: Bearer TOKEN (the daemon's security.token)",
            {"www-authenticate": challenge},
        )

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

    # ---------------------------------------------------------------------------- catalog

    def _catalog(self) -> IndexCatalog:
        if self.view.catalog is None:
            raise ApiError(503, "indexes cannot be changed now")
        return self.view.catalog

    async def _catalog_call(self, call: Awaitable[Any]) -> Any:
        try:
            return await call
        except CatalogError as exc:
            raise ApiError(exc.status, exc.message) from None

    async def create_index(self, body: dict[str, Any], send: Send) -> None:
        name = body.get("name")
        keys = body.get("keys")
        if not isinstance(name, str) or not INDEX_NAME.match(name):
            raise ApiError(400, "name: a letter, then up to 63 letters, digits or _")
        if not isinstance(keys, list) or not 1 <= len(keys) <= MAX_KEYS:
            raise ApiError(400, f"keys: a list of 1 to {MAX_KEYS} field paths")
        for path in keys:
            if not isinstance(path, str) or not FIELD_PATH.match(path):
                raise ApiError(400, f"keys: {path!r} is not a field path like address.zip")
        where = body.get("where")
        if where is not None:
            if not isinstance(where, str):
                raise ApiError(400, 'where: a condition as a string, like "age >= 18"')
            try:
                where = normalize_where(where)
            except WhereError as exc:
                raise ApiError(400, f"where: {exc}") from None
        unknown = set(body) - {"name", "keys", "where"}
        if unknown:
            raise ApiError(400, f"{sorted(unknown)[0]}: unknown member")
        definition = IndexDefinition(name, tuple(keys), where)
        catalog = self._catalog()
        stored = await self._catalog_call(catalog.create(definition))
        build = catalog.builds.get(name)
        entry = self._index_entry(stored, 0) if build is None else self._build_entry(build)
        await _json(send, 201, entry)

    # ---------------------------------------------------------------------------- snapshots

    def _index(self, name: str, query: dict[str, str] | None = None) -> StoredIndex:
        for index in self.view.indexes:
            if index.definition.name == name:
                return index
        build = self.view.catalog.builds.get(name) if self.view.catalog is not None else None
        if build is not None:
            status = build.status()
            if query is None or query.get("consistency", "any") != "any" or "at_plus" in query:
                raise ApiError(
                    409,
                    f"index {name!r} is {status.state} ({status.percent:g}% built): only "
                    "consistency=any reads it before it is active, and sees what is built so far",
                )
            return build.index
        raise ApiError(404, f"no index named {name!r}")

    def _describe(self, snap: StabilitySnapshot) -> dict[str, Any]:
        return {
            "snapshot": snap.number,
            "seqno_sum": snap.timestamp.total,
            "created_at": snap.created_at,
            "seqnos": list(snap.timestamp.seqnos),
            "vbuuids": list(snap.timestamp.vbuuids),
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
        await _json(send, 200, {"id": pin.pin_id, "lease_s": lease, **self._describe(snap)})

    # ---------------------------------------------------------------------------- scans

    def _range(self, index: StoredIndex, query: dict[str, str]) -> KeyRange:
        nkeys = len(index.definition.keys)
        params = {}
        for name in ("eq", "low", "high"):
            if name in query:
                params[name] = parse_json_param(name, query[name])
        bounds = key_range(
            nkeys,
            eq=params.get("eq"),
            low=params.get("low"),
            high=params.get("high"),
            inclusion=query.get("inclusion", "both"),
            has_eq="eq" in params,
            has_low="low" in params,
            has_high="high" in params,
        )
        start = _hex(query, "start")
        stop = _hex(query, "stop")
        lo = max((b for b in (bounds.start, start) if b is not None), default=None)
        hi = min((b for b in (bounds.stop, stop) if b is not None), default=None)
        return KeyRange(lo, hi)

    async def _read_snapshot(self, query: dict[str, str]) -> StabilitySnapshot:
        """The snapshot a read asks for: its pin's, or one at its consistency. `at_plus` alone
        implies consistency=at_plus; a parameter the choice would ignore is a 400."""
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
        snap = (await self._read_snapshot(query)).acquire()
        try:
            if not snap.is_open:
                raise ApiError(410, "the snapshot was released")
            if most and not count_only and limit is None:
                await self._check_rows(index, snap, bounds, most)
            meta = {
                SNAPSHOT_HEADER: str(snap.number),
                SEQNO_SUM_HEADER: str(snap.timestamp.total),
            }
            if count_only:
                n = snap.entry_counts.get(index.definition.name)
                if n is None or bounds.start is not None or bounds.stop is not None:
                    n = await trio.to_thread.run_sync(
                        count_entries, self.view.store, index, snap.store_snapshot, bounds
                    )
                await _json(send, 200, {"count": n, "snapshot": snap.number}, meta)
                return 0
            chunks = _RowCount(
                entry_batches(
                    self.view.store, index, snap.store_snapshot, bounds, limit, SCAN_CHUNK
                )
            )
            self.active_scans += 1
            try:
                if ARROW in headers.get("accept", ""):
                    await self._stream_arrow(index, snap, chunks, send, meta)
                else:
                    await self._stream_ndjson(chunks, send, meta)
            finally:
                self.active_scans -= 1
            return chunks.rows
        finally:
            snap.release()

    async def _check_rows(
        self, index: StoredIndex, snap: StabilitySnapshot, bounds: KeyRange, most: int
    ) -> None:
        """413 before any row is sent when a scan without a limit would pass `most` rows:
        counted on the snapshot it reads, up to most + 1 entries (none when the whole index
        is small enough)."""
        total = snap.entry_counts.get(index.definition.name)
        if total is not None and total <= most:
            return
        over = await trio.to_thread.run_sync(
            more_than, self.view.store, index, snap.store_snapshot, bounds, most
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
        self, chunks: Iterator[EntryBatch], send: Send, meta: dict[str, str]
    ) -> None:
        await _start(send, 200, NDJSON, meta)
        while (body := await trio.to_thread.run_sync(_ndjson_chunk, chunks)) is not None:
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _stream_arrow(
        self,
        index: StoredIndex,
        snap: StabilitySnapshot,
        chunks: Iterator[EntryBatch],
        send: Send,
        meta: dict[str, str],
    ) -> None:
        paths = index.definition.keys
        schema = pa.schema(
            [pa.field("id", pa.string())] + [pa.field(p, pa.string()) for p in paths],
            metadata={
                "indexer.snapshot": str(snap.number),
                "indexer.seqno_sum": str(snap.timestamp.total),
            },
        )
        sink = _Chunks()
        writer = pa.ipc.new_stream(sink, schema)
        await _start(send, 200, ARROW, meta)
        # Decoding, JSON texts and the Arrow batch are built in the thread, off the event loop.
        while await trio.to_thread.run_sync(_arrow_chunk, chunks, writer, schema):
            await send({"type": "http.response.body", "body": sink.take(), "more_body": True})
        writer.close()
        await send({"type": "http.response.body", "body": sink.take(), "more_body": False})

    async def split(self, index: StoredIndex, query: dict[str, str], send: Send) -> None:
        parts = int(_number(query.get("parts", "4"), "parts", 1, 10_000))
        snap = (await self._read_snapshot(query)).acquire()
        try:
            ranges = await trio.to_thread.run_sync(
                splits, self.view.store, index, snap.store_snapshot, parts
            )
        finally:
            snap.release()
        out = [
            {"start": r.start.hex() if r.start else None, "stop": r.stop.hex() if r.stop else None}
            for r in ranges
        ]
        await _json(send, 200, {"splits": out, "snapshot": snap.number})

    # ---------------------------------------------------------------------------- state

    def _index_entry(self, index: StoredIndex, entries: int) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": index.definition.name,
            "keys": list(index.definition.keys),
            "state": index.state,
            "entries": entries,
        }
        if index.definition.where is not None:
            out["where"] = index.definition.where
        if index.state == "incremental":
            out["note"] = "created at run time: holds the mutations streamed since its creation"
        return out

    def index_list(self) -> list[dict[str, Any]]:
        counts = self.view.timekeeper.statistics().entry_counts
        out = [self._index_entry(i, counts[j]) for j, i in enumerate(self.view.indexes)]
        for build in self._builds():
            out.append(self._build_entry(build))
        return out

    def _builds(self) -> list[IndexBuild]:
        catalog = self.view.catalog
        return [] if catalog is None else list(catalog.builds.values())

    def _build_entry(self, build: IndexBuild) -> dict[str, Any]:
        status = build.status()
        out = self._index_entry(build.index, build.entries)
        out["state"] = status.state
        out["build"] = asdict(status)
        return out

    def _all_indexes(self) -> list[StoredIndex]:
        """Every index with entries in the store: those maintained and those being built."""
        return [*self.view.indexes, *(b.index for b in self._builds())]

    async def measure_disk(self) -> None:
        """Measure `bytes_on_disk` of every index again (LevelDB's estimate, in a thread)."""
        indexes = self._all_indexes()
        sizes = await trio.to_thread.run_sync(self.view.store.approximate_bytes, indexes)
        self.bytes_on_disk = {i.definition.name: n for i, n in zip(indexes, sizes, strict=True)}

    def index_stats(self, name: str, entries: int) -> dict[str, Any]:
        """One index's entry in /stats: entries, bytes on disk (as last measured) and reads."""
        reads = self.reads.get(name) or IndexReads()
        return {
            "entries": entries,
            "bytes_on_disk": self.bytes_on_disk.get(name, 0),
            "scans": reads.scans,
            "rows": reads.rows,
            "scan_latency_s": reads.latency.summary(),
        }

    async def index_details(self, name: str) -> dict[str, Any]:
        """GET /indexes/NAME: its entry of /indexes with its entry of /stats, or a 404."""
        if not any(i.definition.name == name for i in self._all_indexes()):
            raise ApiError(404, f"no index named {name!r}")
        await self.measure_disk()
        for entry in self.index_list():  # the index may have been dropped meanwhile
            if entry["name"] == name:
                return {**entry, **self.index_stats(name, entry["entries"])}
        raise ApiError(404, f"no index named {name!r}")

    def stats(self) -> dict[str, Any]:
        v = self.view
        snaps = v.snapshots
        hwt = v.hwt
        owned = [vb for vb, flag in enumerate(v.registry.owned) if flag]
        return {
            "version": self.version,
            "uptime_s": round(time.time() - self.started_at, 3),
            "source": v.registry.source,  # the identity of the history indexed (None: none yet)
            "vbuckets": {
                "count": hwt.num_vbuckets,
                "owned": len(owned),
                "streaming": sum(1 for o in v.registry.owner if o is not None),
                "hwt_seqno_sum": sum(hwt.seqnos),
                "hwt_max_seqno": max(hwt.seqnos, default=0),
                "received_seqno_sum": sum(v.registry.received),
            },
            "stable": {
                "snapshot": snaps.stable.number if snaps.stable else None,
                "seqno_sum": snaps.stable.timestamp.total if snaps.stable else 0,
                "age_s": round(time.time() - snaps.stable.created_at, 3) if snaps.stable else None,
            },
            "persisted": {
                "seqno_sum": snaps.persisted.total,
                "snapshot": snaps.persisted_snapshot.number if snaps.persisted_snapshot else None,
            },
            "builds": {b.name: asdict(b.status()) for b in self._builds()},
            "compaction": None if v.compactor is None else v.compactor.statistics(),
            "storage": {"level0_files": v.store.level0_files()},
            "collector": None if v.collector is None else asdict(v.collector.statistics()),
            "snapshots": asdict(snaps.statistics()),
            "queues": [asdict(w.statistics()) for w in v.workers],
            "slab": asdict(v.pool.statistics()),
            "throttle": asdict(v.throttle.statistics()),
            "reader": asdict(v.registry.statistics()),
            "timekeeper": asdict(v.timekeeper.statistics()),
            "indexes": {
                i["name"]: self.index_stats(i["name"], i["entries"]) for i in self.index_list()
            },
            "scans_in_flight": self.scans_in_flight,
            "scans_active": self.active_scans,
            "scans_served": self.scans_served,
            "refused": dict(self.refused),
        }


class _Collector:
    """Prometheus metrics read from the stages' statistics at scrape time: counters as
    counters (`_total`), levels as gauges, latencies as histograms."""

    def __init__(self, api: HttpApi) -> None:
        self.api = api

    def collect(self) -> Iterator[Metric]:
        api = self.api
        v = api.view
        slab = v.pool.statistics()
        throttle = v.throttle.statistics()
        tk = v.timekeeper.statistics()
        snaps = v.snapshots.statistics()
        reader = v.registry.statistics()
        queues = [w.statistics() for w in v.workers]

        yield build_info("indexer")
        # Counters: totals since the daemon started.
        yield counter(
            "indexer_mutations_received_total", "Mutations received from routers", reader.mutations
        )
        yield counter(
            "indexer_mutations_flushed_total",
            "Mutations written to the store",
            tk.mutations_flushed,
        )
        yield counter(
            "indexer_protocol_errors_total",
            "Connections refused for protocol errors",
            reader.protocol_errors,
        )
        yield counter(
            "indexer_throttle_pauses_total", "Times reads were paused for memory", throttle.pauses
        )
        yield counter(
            "indexer_store_write_errors_total",
            "Failed store writes (a full disk), each retried",
            sum(q.write_errors for q in queues),
        )
        yield counter(
            "indexer_persist_errors_total",
            "Failed persists of a snapshot (a full disk), each retried",
            tk.persist_errors,
        )
        refused = CounterMetricFamily(
            "indexer_http_refused_total", "HTTP requests refused, by reason", labels=["reason"]
        )
        for reason, n in api.refused.items():
            refused.add_metric([reason], n)
        yield refused
        # Per index: reads answered, rows, latency; entries, bytes on disk, build progress.
        names = [i.definition.name for i in api._all_indexes()]
        reads = [(name, api.reads.get(name) or IndexReads()) for name in names]
        scans = CounterMetricFamily(
            "indexer_scans_total", "Scan and count requests answered", labels=["index"]
        )
        rows = CounterMetricFamily(
            "indexer_scan_rows_total", "Rows returned by scans", labels=["index"]
        )
        for name, r in reads:
            scans.add_metric([name], r.scans)
            rows.add_metric([name], r.rows)
        yield scans
        yield rows
        yield histogram_family(
            "indexer_scan_duration_seconds",
            "Latency of scan and count requests, from the index's lookup to the last byte",
            [([name], r.latency) for name, r in reads],
            ["index"],
        )
        yield histogram_family(
            "indexer_flush_duration_seconds",
            "Time a flush of every worker's queue to the store took",
            [((), v.timekeeper.flush_seconds)],
            (),
        )
        yield histogram_family(
            "indexer_persist_lag_seconds",
            "Age of a readable snapshot when it was persisted",
            [((), v.timekeeper.persist_lag_seconds)],
            (),
        )
        entries = GaugeMetricFamily(
            "indexer_index_entries", "Entries per active index", labels=["index"]
        )
        for j, index in enumerate(v.indexes):
            entries.add_metric([index.definition.name], tk.entry_counts[j])
        yield entries
        on_disk = GaugeMetricFamily(
            "indexer_index_bytes_on_disk",
            "LevelDB's estimate of an index's bytes in its table files",
            labels=["index"],
        )
        for name in names:
            on_disk.add_metric([name], api.bytes_on_disk.get(name, 0))
        yield on_disk
        progress = GaugeMetricFamily(
            "indexer_build_progress_ratio",
            "How much of an index's initial build is done, 0 to 1",
            labels=["index"],
        )
        for build in api._builds():
            progress.add_metric([build.name], build.status().percent / 100)
        yield progress
        # Gauges: levels now.
        yield gauge("indexer_persist_failing", "1 while persists fail", int(tk.persist_failing))
        errors = [q.write_error for q in queues if q.write_failing] + [tk.persist_error]
        yield gauge(
            "indexer_disk_full",
            "1 while a store write or a persist fails for lack of space",
            int(any(NO_SPACE in (e or "") for e in errors)),
        )
        yield gauge(
            "indexer_scans_in_flight",
            "Scan, count and split requests being served",
            api.scans_in_flight,
        )
        yield gauge(
            "indexer_slab_chunk_bytes_in_use",
            "Slab chunk bytes holding queued mutations",
            slab.chunk_bytes_in_use,
        )
        yield gauge("indexer_slab_total_bytes", "Slab pool size", slab.total_bytes)
        yield gauge(
            "indexer_throttle_paused", "1 while reads are paused for memory", int(throttle.paused)
        )
        yield gauge("indexer_rss_bytes", "Process resident memory at the last sample", throttle.rss)
        yield gauge("indexer_router_connections", "Open router connections", reader.connections)
        yield gauge(
            "indexer_stable_seqno_sum",
            "Seqno sum of the latest readable snapshot",
            snaps.stable_total,
        )
        yield gauge(
            "indexer_persisted_seqno_sum",
            "Seqno sum of the persisted snapshot",
            snaps.persisted_total,
        )
        yield gauge("indexer_snapshot_pins", "Pinned snapshots", snaps.pins)
        queued = GaugeMetricFamily(
            "indexer_queued_mutations", "Mutations queued", labels=["worker"]
        )
        for q in queues:
            queued.add_metric([str(q.worker)], q.queued)
        yield queued
        if v.collector is not None:
            yield from collector_metrics("indexer", v.collector)


class _Chunks(io.RawIOBase):
    """A write-only file collecting what pyarrow writes, handed out chunk by chunk."""

    def __init__(self) -> None:
        super().__init__()
        self._parts: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out = b"".join(self._parts)
        self._parts.clear()
        return out


class _RowCount:
    """Entry batches passed through, counting their rows (in the scan's worker thread)."""

    def __init__(self, batches: Iterator[EntryBatch]) -> None:
        self.batches = batches
        self.rows = 0

    def __iter__(self) -> _RowCount:
        return self

    def __next__(self) -> EntryBatch:
        batch = next(self.batches)
        self.rows += len(batch)
        return batch


def _ndjson_chunk(batches: Iterator[EntryBatch]) -> bytes | None:
    """The next batch of rows as NDJSON lines (the JSON of a key is built once per batch)."""
    batch = next(batches, None)
    if batch is None:
        return None
    heads = []
    tails = []
    for values in batch.keys:
        row = Row(values, "").as_json()
        heads.append('{"key": ' + json_encode(row["key"]) + ', "id": ')
        tails.append(
            ', "missing": ' + json_encode(row["missing"]) + "}\n" if "missing" in row else "}\n"
        )
    lines = [
        heads[c] + json_encode(docid) + tails[c]
        for c, docid in zip(batch.codes.to_pylist(), batch.docids.to_pylist(), strict=True)
    ]
    return "".join(lines).encode()


def _arrow_chunk(batches: Iterator[EntryBatch], writer: Any, schema: pa.Schema) -> bool:
    """Write the next batch of rows as one record batch; False at the end."""
    batch = next(batches, None)
    if batch is None:
        return False
    columns = [batch.docids]
    for j in range(len(schema) - 1):
        texts = pa.array([json_text(values[j]) for values in batch.keys], pa.string())
        columns.append(texts.take(batch.codes))
    writer.write_batch(pa.RecordBatch.from_arrays(columns, schema=schema))
    return True


def _only(method: str, *allowed: str) -> None:
    if method not in allowed:
        methods = ", ".join(allowed)
        raise ApiError(405, f"{method} not allowed here; use {methods}", {"allow": methods})


def _query(raw: bytes) -> dict[str, str]:
    """The query string's parameters (blank ones too); one given twice is a 400."""
    query: dict[str, str] = {}
    for name, value in parse_qsl(raw.decode(errors="replace"), keep_blank_values=True):
        if name in query:
            raise ApiError(400, f"{name}: given more than once")
        query[name] = value
    return query


def _params(query: dict[str, str], allowed: tuple[str, ...], route: str) -> None:
    """400 naming the parameters `route` does not take, rather than ignoring them."""
    unknown = sorted(set(query) - set(allowed))
    if unknown:
        takes = f"it takes {', '.join(allowed)}" if allowed else "it takes none"
        names = ", ".join(repr(name) for name in unknown)
        plural = "s" if len(unknown) > 1 else ""
        raise ApiError(400, f"unknown query parameter{plural} {names} for {route}: {takes}")


def _plain(number: float) -> str:
    """A bound as a person writes it: whole numbers in full, not as 4.61169e+18."""
    return str(int(number)) if float(number).is_integer() else f"{number:g}"


def _number(value: Any, name: str, low: float, high: float) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ApiError(400, f"{name}: a number, not {value!r}") from None
    if math.isnan(number) or not low <= number <= high:
        raise ApiError(400, f"{name}: from {_plain(low)} to {_plain(high)}, not {value!r}")
    return number


def _hex(query: dict[str, str], name: str) -> bytes | None:
    if name not in query or query[name] == "":
        return None
    try:
        return bytes.fromhex(query[name])
    except ValueError:
        raise ApiError(400, f"{name}: hexadecimal encoded key bytes") from None


def _vector(value: Any, num_vbuckets: int) -> list[tuple[int, int]]:
    """An at_plus vector: {"vbucket": seqno, ...} or a list of seqnos, one per vbucket."""
    if isinstance(value, list):
        items = list(enumerate(value))
    elif isinstance(value, dict):
        try:
            items = [(int(k), v) for k, v in value.items()]
        except ValueError:
            raise ApiError(400, "at_plus: keys are vbucket numbers") from None
    else:
        raise ApiError(400, "at_plus: {vbucket: seqno, ...} or a list of seqnos")
    for vb, seqno in items:
        if not 0 <= vb < num_vbuckets:
            raise ApiError(400, f"at_plus: vbucket {vb} is outside 0-{num_vbuckets - 1}")
        if not isinstance(seqno, int) or isinstance(seqno, bool) or seqno < 0:
            raise ApiError(400, f"at_plus: seqno of vbucket {vb} must be a whole number >= 0")
    return items


async def _body_json(receive: Receive) -> dict[str, Any]:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if len(body) > 1 << 20:
            raise ApiError(413, "request body over 1 MiB")
        if not message.get("more_body"):
            break
    if not body:
        return {}
    try:
        value = json.loads(body)
    except ValueError:
        raise ApiError(400, "the body is not JSON") from None
    if not isinstance(value, dict):
        raise ApiError(400, "the body must be a JSON object")
    return value


def _headers_only(send: Send) -> Send:
    """The `send` of a HEAD request: the status and headers GET would give, no body."""

    async def send_head(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            message = {**message, "body": b""}
        await send(message)

    return send_head


async def _start(send: Send, status: int, content_type: str, extra: dict[str, str]) -> None:
    headers = [(b"content-type", content_type.encode())]
    headers += [(k.encode(), v.encode()) for k, v in extra.items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})


async def _respond(
    send: Send, status: int, body: bytes, content_type: str, extra: dict[str, str] | None = None
) -> None:
    await _start(send, status, content_type, extra or {})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _json(send: Send, status: int, value: Any, extra: dict[str, str] | None = None) -> None:
    await _respond(send, status, json.dumps(value).encode() + b"\n", JSON, extra)

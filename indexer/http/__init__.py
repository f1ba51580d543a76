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

    POST   /indexes                  create an index (a build over existing data; with
                                     "defer_build": true only stored, state deferred)
    POST   /indexes/_build           build deferred indexes together, on one build stream
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

One module per job, each class adding its methods to the one before: `wire` (routes, errors,
reading requests and writing answers), `state` (the daemon as the API sees it, the counters,
what the indexes are), `stats` (GET /stats, GET /metrics), `admin` (the catalog: POST /indexes,
POST /indexes/_build, GET and DELETE /indexes/NAME), `scans` (scans, counts, splits and pins)
and `app` (the ASGI application: routing and the token check).
"""

from __future__ import annotations

from indexer.http.app import HttpApi
from indexer.http.state import DaemonView
from indexer.http.wire import ApiError

__all__ = ["ApiError", "DaemonView", "HttpApi"]

"""GET /stats and GET /metrics (the Prometheus collector reads the daemon at scrape time)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from indexer.config import LimitsConfig, SecurityConfig
from indexer.http.state import ApiState, DaemonView, IndexReads
from indexer.http.wire import NO_SPACE
from indexer.metrics import build_info, collector_metrics, counter, gauge, histogram_family


class StatsRoutes(ApiState):
    """GET /stats and GET /metrics: the daemon's figures, read when asked."""

    def __init__(
        self,
        view: DaemonView,
        security: SecurityConfig | None = None,
        limits: LimitsConfig | None = None,
    ) -> None:
        super().__init__(view, security, limits)
        self.metrics.register(_Collector(self))

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
            "builds": {name: asdict(b.status()) for name, b in self._builds()},
            "compaction": None if v.compactor is None else v.compactor.statistics(),
            "rollbacks": None if v.rollback is None else v.rollback.statistics(),
            "changes": self._changes(),
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

    def _changes(self) -> dict[str, Any] | None:
        """The change history kept, and what each bound of its retention holds now."""
        retention = self.view.timekeeper.retention
        if retention is None:
            return None
        return retention.history.statistics(
            retention.keep_s, retention.keep_snapshots, retention.keep_bytes
        )

    def _served(self, name: str, rows: int, seconds: float) -> None:
        """Count a scan or count request answered: its rows and how long it took."""
        reads = self.reads.setdefault(name, IndexReads())
        reads.scans += 1
        reads.rows += rows
        reads.latency.observe(seconds)
        self.scans_served += 1


class _Collector:
    """Prometheus metrics read from the stages' statistics at scrape time: counters as
    counters (`_total`), levels as gauges, latencies as histograms."""

    def __init__(self, api: StatsRoutes) -> None:
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
        for name, build in api._builds():
            progress.add_metric([name], build.status().percent / 100)
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

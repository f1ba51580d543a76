"""The router's `GET /metrics`: its `/stats` in the Prometheus text format, read at scrape time.

Counters are Prometheus counters, exposed with `_total`; everything else is a gauge. `node` is
a node's `HOST:PORT`, or `HOST:PORT/build:NAME` for a build stream, as in `/stats`.

    indexer_router_build_info{version}                  1, with the package's version
    indexer_router_node_sent_total{node}                items sent from memory
    indexer_router_node_backfilled_total{node}          items sent from the source log
    indexer_router_node_superseded_total{node}          versions a backfill left out
    indexer_router_node_connections_total{node}         connections made (handshakes answered)
    indexer_router_cursors_dropped_total                cursors dropped over the memory cap
    indexer_router_snapshots_collapsed_total            Mutation Manager snapshots collapsed
    indexer_router_items_expelled_total                 items no cursor needed any more
    indexer_router_documents_expired_total              documents the expiry pager deleted
    indexer_router_http_refused_total                   HTTP changes refused (no token)
    indexer_router_gc_collections_total{generation}     cycle collections
    indexer_router_node_connected{node}                 1 while connected
    indexer_router_node_backfilling_vbuckets{node}      vbuckets it reads from the log now
    indexer_router_node_stopped{node}                   1 once refused for good (another source)
    indexer_router_memory_bytes, indexer_router_memory_capacity_bytes, indexer_router_items,
    indexer_router_snapshots, indexer_router_cursors    the Mutation Manager now
    indexer_router_expiry_pending                       documents with an expiry to come
    indexer_router_source_high_seqno_sum                the source log's high seqnos, summed
    indexer_router_gc_pause_longest_seconds{generation}
    process_*                                           the process's CPU, memory, files, start
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from indexer.collector import CollectorPauses
from indexer.metrics import build_info, collector_metrics, counter, gauge
from indexer.router.source.appender import Appender
from indexer.router.streams.node_stream import NodeProgress


class RouterView(Protocol):
    """What the collector reads of a router (its HTTP app, service.DocsApi)."""

    @property
    def appender(self) -> Appender: ...

    @property
    def progress(self) -> Mapping[str, NodeProgress]: ...

    @property
    def refused(self) -> int: ...

    @property
    def collector(self) -> CollectorPauses | None: ...


PREFIX = "indexer_router"

# NodeProgress counters: (field, metric name, help).
NODE_COUNTERS = (
    ("sent", "node_sent_total", "Items sent to the node from memory"),
    ("backfilled", "node_backfilled_total", "Items sent to the node from the source log"),
    ("superseded", "node_superseded_total", "Versions a backfill read and left out"),
    ("connections", "node_connections_total", "Connections made to the node"),
)


class RouterCollector:
    """Reads the router's Mutation Manager, node progress, source log and counters when
    Prometheus scrapes (registered on the router app's own registry)."""

    def __init__(self, api: RouterView) -> None:
        self.api = api

    def collect(self) -> Iterator[Metric]:
        api = self.api
        appender = api.appender
        mm = appender.mm.stats()
        source = appender.source
        nodes = list(api.progress.items())

        yield build_info(PREFIX)
        for attribute, name, doc in NODE_COUNTERS:
            family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["node"])
            for node, progress in nodes:
                family.add_metric([node], getattr(progress, attribute))
            yield family
        yield counter(
            f"{PREFIX}_cursors_dropped_total",
            "Cursors dropped to the source log over the memory cap",
            mm.cursors_dropped,
        )
        yield counter(
            f"{PREFIX}_snapshots_collapsed_total",
            "Mutation Manager snapshots collapsed into one",
            mm.snapshots_collapsed,
        )
        yield counter(
            f"{PREFIX}_items_expelled_total",
            "Mutation Manager items expelled (no cursor needed them)",
            mm.items_expelled,
        )
        yield counter(
            f"{PREFIX}_documents_expired_total",
            "Documents the expiry pager deleted",
            appender.expired,
        )
        yield counter(
            f"{PREFIX}_http_refused_total", "HTTP changes refused for a missing token", api.refused
        )
        connected = GaugeMetricFamily(
            f"{PREFIX}_node_connected", "1 while the node's stream is connected", labels=["node"]
        )
        backfilling = GaugeMetricFamily(
            f"{PREFIX}_node_backfilling_vbuckets",
            "Vbuckets the node's stream reads from the source log now",
            labels=["node"],
        )
        stopped = GaugeMetricFamily(
            f"{PREFIX}_node_stopped",
            "1 once the node refused this router for good (another source): see last_error",
            labels=["node"],
        )
        for node, progress in nodes:
            connected.add_metric([node], int(progress.connected))
            backfilling.add_metric([node], progress.backfilling)
            stopped.add_metric([node], int(progress.stopped))
        yield connected
        yield backfilling
        yield stopped
        yield gauge(f"{PREFIX}_memory_bytes", "Mutation Manager memory in use", mm.memory)
        yield gauge(f"{PREFIX}_memory_capacity_bytes", "Mutation Manager memory cap", mm.capacity)
        yield gauge(f"{PREFIX}_items", "Items the Mutation Manager holds", mm.items)
        yield gauge(f"{PREFIX}_snapshots", "Snapshots the Mutation Manager holds", mm.snapshots)
        yield gauge(f"{PREFIX}_cursors", "Cursors in the Mutation Manager", mm.cursors)
        yield gauge(
            f"{PREFIX}_expiry_pending",
            "Documents whose expiry is still to come",
            source.pending_expiries,
        )
        yield gauge(
            f"{PREFIX}_source_high_seqno_sum",
            "The source log's high seqnos, summed over vbuckets",
            sum(source.high_seqno(vb) for vb in source.vbuckets_with_history()),
        )
        if api.collector is not None:
            yield from collector_metrics(PREFIX, api.collector)

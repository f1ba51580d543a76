"""Every HTTP route of the daemon and of the router, in one place: the `--help` of `indexer
serve` and `indexer router` print them, the README's table lists them, and a test holds the
three and the servers to each other. Sans-IO: data only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Route:
    """One method on one path (NAME, ID, VB: parts the caller fills in), and what it does."""

    method: str
    path: str
    what: str


DAEMON_ROUTES = (
    Route("GET", "/health", "200 once ready, 503 while starting (HEAD too)"),
    Route("GET", "/stats", "uptime, HWT, snapshots, queues, indexes, builds"),
    Route("GET", "/metrics", "Prometheus text format"),
    Route("GET", "/indexes", "every index: definition and state"),
    Route("POST", "/indexes", "create an index (built over the data already streamed)"),
    Route("POST", "/indexes/_build", "build deferred indexes together"),
    Route("GET", "/indexes/NAME", "one index: definition, state, size, scans"),
    Route("DELETE", "/indexes/NAME", "drop an index"),
    Route("GET", "/indexes/NAME/scan", "entries of a range or spans, NDJSON or Arrow"),
    Route("GET", "/indexes/NAME/count", "how many entries a scan would answer"),
    Route("GET", "/indexes/NAME/aggregate", "count, min, max, sum, avg per group"),
    Route("GET", "/indexes/NAME/changes", "entries inserted and deleted between snapshots"),
    Route("GET", "/indexes/NAME/splits", "key ranges of about equal size (for Spark)"),
    Route("GET", "/indexes/NAME/types", "the JSON types each key holds"),
    Route("GET", "/indexes/NAME/docs/ID", "the entries of one document"),
    Route("POST", "/compact", "compact the store now"),
    Route("GET", "/snapshots", "the readable and persisted snapshots, and pins"),
    Route("POST", "/snapshots/pin", "hold a snapshot for a lease"),
    Route("POST", "/snapshots/ID/renew", "extend a pin's lease"),
    Route("DELETE", "/snapshots/ID", "release a pin"),
    Route("PUT", "/changes/leases/NAME", "keep the change history from a token for a consumer"),
    Route("DELETE", "/changes/leases/NAME", "end a consumer's lease"),
)

ROUTER_ROUTES = (
    Route("PUT", "/docs/ID", "store a document (the body), synced before the 200"),
    Route("DELETE", "/docs/ID", "delete a document"),
    Route("POST", "/docs/_bulk", "many documents, JSONL as --jsonl reads it"),
    Route("POST", "/failover/VB", "a new history for a vbucket (a failover)"),
    Route("GET", "/stats", "appended, streams, nodes, inputs"),
    Route("GET", "/metrics", "Prometheus text format"),
)


def routes_help(routes: Sequence[Route]) -> str:
    """The routes as lines of a click help text (`\\b` keeps click from rewrapping them)."""
    width = max(len(f"{r.method} {r.path}") for r in routes)
    lines = [f"  {f'{r.method} {r.path}':<{width}}  {r.what}" for r in routes]
    return "\b\n" + "\n".join(lines)

"""The source's options, read and checked once on the driver (`SourceOptions`), and its error."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from indexer.client import Access

FORMAT = "indexer"
DEFAULT_PARTITIONS = 4
DEFAULT_LEASE_S = 600.0
DEFAULT_TIMEOUT_S = 120.0
SNAPSHOTS = ("persisted", "stable")
OPTIONS = (
    "url path cluster_map cluster index partitions snapshot consistency at_plus pin lease_s "
    "timeout pushdown columns order token token_file tls tls_ca "
    "startingoffsets endingoffsets maxentriespertrigger consumer"  # the change feed (stream.py)
)
COLUMNS = ("typed", "json")


log = logging.getLogger("indexer.spark")


class IndexerSourceError(Exception):
    """The source cannot read: bad options, the daemon said no, the store is held. One line."""


def parse_access(opts: Mapping[str, str]) -> Access:
    """The token (`token`, or the first line of `token_file`) and TLS (`tls_ca`, `tls`)."""
    token = opts.get("token") or None
    token_file = opts.get("token_file") or None
    if token is not None and token_file is not None:
        raise IndexerSourceError("give the token or token_file option, not both")
    if token_file is not None:
        try:
            lines = Path(token_file).read_text(encoding="utf-8").strip().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise IndexerSourceError(f"token_file: cannot read {token_file}: {exc}") from None
        token = lines[0].strip() if lines else ""
    if token is not None and (not token or any(c <= " " or c > "~" for c in token)):
        raise IndexerSourceError("token: visible ASCII characters (no spaces)")
    ca_pem = None
    tls_ca = opts.get("tls_ca") or None
    if tls_ca is not None:
        try:
            ca_pem = Path(tls_ca).read_text(encoding="ascii")
            ssl.create_default_context(cadata=ca_pem)
        except (OSError, UnicodeDecodeError, ssl.SSLError, ValueError) as exc:
            raise IndexerSourceError(f"tls_ca: cannot load {tls_ca}: {exc}") from None
    tls = opts.get("tls", "false").lower()
    if tls not in ("true", "false"):
        raise IndexerSourceError(f'tls: "true" or "false", not {tls!r}')
    return Access(token, ca_pem, tls == "true" or ca_pem is not None)


@dataclass(frozen=True)
class SourceOptions:
    """The reader's options, checked once."""

    index: str
    url: str | None = None
    path: str | None = None
    cluster_map: str | None = None  # a cluster map file, read on the driver only
    partitions: int | None = None
    snapshot: str = "persisted"
    at_plus: dict[str, int] | None = None
    pin: str | None = None
    lease_s: float = DEFAULT_LEASE_S
    timeout: float = DEFAULT_TIMEOUT_S
    # Off unless `register` found a Spark that keeps the read plan per scan: Spark 4.3 keeps the
    # plan made while pushing a query's filters on the DataFrame and serves it to every later
    # scan of it (docs/spark.md), which would silently drop rows. Off, every plan reads
    # everything and Spark filters after the read.
    pushdown: bool = False
    # "typed": each key column gets the Spark type of what the index holds there (JSON text
    # where it holds several types); "json": JSON text for every key column.
    columns: str = "typed"
    # "desc": partitions in reverse index order, each read from its end, so the rows come
    # last entry first (a `limit` reads the last entries).
    order: str = "asc"
    access: Access = dataclasses.field(default_factory=Access)  # token and TLS of online reads

    @classmethod
    def parse(cls, options: Mapping[str, str], default_pushdown: bool = False) -> SourceOptions:
        """Options as given to `spark.read.option(...)` (keys are case-insensitive);
        `default_pushdown` applies when the `pushdown` option is not given."""
        opts = {k.lower(): v for k, v in options.items()}
        unknown = sorted(set(opts) - set(OPTIONS.split()))
        if unknown:
            raise IndexerSourceError(
                f"unknown option {unknown[0]!r}; known: {', '.join(OPTIONS.split())}"
            )
        index = opts.get("index", "")
        if not index:
            raise IndexerSourceError('give the index to read: .option("index", "NAME")')
        url, path = opts.get("url") or None, opts.get("path") or None
        # `cluster`: the map in etcd (etcd://HOST:PORT/PREFIX); `cluster_map` takes either.
        if opts.get("cluster_map") and opts.get("cluster"):
            raise IndexerSourceError('give .option("cluster_map", ...) or .option("cluster", ...)')
        cluster_map = opts.get("cluster_map") or opts.get("cluster") or None
        if sum(x is not None for x in (url, path, cluster_map)) != 1:
            raise IndexerSourceError(
                'give exactly one of .option("url", "http://HOST:PORT") (a running daemon), '
                '.option("path", DATA_DIR) (a stopped node\'s data directory) and '
                '.option("cluster_map", MAP_FILE) or .option("cluster", "etcd://HOST:PORT/PREFIX") '
                "(every node of a cluster map)"
            )
        snapshot = opts.get("snapshot", opts.get("consistency", "persisted"))
        if snapshot not in SNAPSHOTS:
            raise IndexerSourceError(f'snapshot: "persisted" or "stable", not {snapshot!r}')
        at_plus = _at_plus(opts["at_plus"]) if opts.get("at_plus") else None
        pin = opts.get("pin") or None
        if path is not None and (at_plus is not None or pin is not None or snapshot != "persisted"):
            raise IndexerSourceError(
                "offline reads (path) give the persisted snapshot only: snapshot, at_plus and "
                "pin need the url or cluster_map option"
            )
        if pin is not None and at_plus is not None:
            raise IndexerSourceError("give pin or at_plus, not both")
        access = parse_access(opts)
        if path is not None and access != Access():
            raise IndexerSourceError(
                "offline reads (path) open the store itself: token, token_file, tls and tls_ca "
                "are for the url or cluster_map option"
            )
        columns = opts.get("columns", "typed")
        if columns not in COLUMNS:
            raise IndexerSourceError(f'columns: "typed" or "json", not {columns!r}')
        order = opts.get("order", "asc").lower()
        if order not in ("asc", "desc"):
            raise IndexerSourceError(f'order: "asc" or "desc", not {order!r}')
        pushdown = opts.get("pushdown", str(default_pushdown)).lower()
        if pushdown not in ("true", "false"):
            raise IndexerSourceError(f'pushdown: "true" or "false", not {pushdown!r}')
        return cls(
            index=index,
            url=url.rstrip("/") if url else None,
            path=path,
            cluster_map=cluster_map,
            partitions=whole_option(opts, "partitions", 1, 10_000),
            snapshot=snapshot,
            at_plus=at_plus,
            pin=pin,
            lease_s=seconds_option(opts, "lease_s", DEFAULT_LEASE_S),
            timeout=seconds_option(opts, "timeout", DEFAULT_TIMEOUT_S),
            pushdown=pushdown == "true",
            columns=columns,
            order=order,
            access=access,
        )


def _at_plus(text: str) -> dict[str, int]:
    try:
        value = json.loads(text)
    except ValueError:
        raise IndexerSourceError(f"at_plus: not JSON: {text[:80]!r}") from None
    if isinstance(value, list):
        value = {str(vb): s for vb, s in enumerate(value)}
    if not isinstance(value, dict) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in value.values()
    ):
        raise IndexerSourceError('at_plus: {"VBUCKET": SEQNO, ...} with whole seqnos >= 0')
    return {str(k): int(v) for k, v in value.items()}


def whole_option(opts: Mapping[str, str], name: str, low: int, high: int) -> int | None:
    if name not in opts:
        return None
    try:
        value = int(opts[name])
    except ValueError:
        raise IndexerSourceError(f"{name}: a whole number, not {opts[name]!r}") from None
    if not low <= value <= high:
        raise IndexerSourceError(f"{name}: from {low} to {high}, not {value}")
    return value


def seconds_option(opts: Mapping[str, str], name: str, default: float) -> float:
    if name not in opts:
        return default
    try:
        value = float(opts[name])
    except ValueError:
        raise IndexerSourceError(f"{name}: a number of seconds, not {opts[name]!r}") from None
    if not value > 0 or math.isinf(value):
        raise IndexerSourceError(f"{name}: a number of seconds above 0, not {opts[name]!r}")
    return value

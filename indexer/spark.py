"""A Spark 4 Python Data Source over the indexer: `spark.read.format("indexer")`.

    from indexer.spark import session
    spark = session("my-job")                     # PYSPARK_PYTHON set, source registered
    df = (spark.read.format("indexer")
          .option("url", "http://127.0.0.1:9102")  # or .option("path", DATA_DIR): offline
          .option("index", "by_city")                # or .option("cluster_map", MAP): all nodes
          .load())

Planning (a Python worker on the driver) pins one snapshot through the daemon's HTTP API (or,
offline, notes the persisted snapshot file), asks for key ranges of about equal size and turns
each into a partition; every partition reads that snapshot as Arrow record batches. Range
filters on the leading key column narrow the scanned key range. With a cluster map it does the
same on every node (one pin per node, the partitions shared out by entry count), each partition
reading one range of one node. A daemon with a shared token or TLS (docs/security.md) is read
with `.option("token_file", FILE)` (or `token`) and `.option("tls_ca", PEM_FILE)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import logging
import math
import os
import random
import ssl
import struct
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import SparkSession
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    InputPartition,
    IsNotNull,
    LessThan,
    LessThanOrEqual,
)
from pyspark.sql.types import (
    BooleanType,
    ByteType,
    DataType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructField,
    StructType,
)

from indexer.client import ARROW_STREAM, ClientError, request
from indexer.client import Access as Access  # the source's users take it from here
from indexer.cluster import ClusterMap, ClusterMapError, load_cluster_map
from indexer.keys import MISSING, encode_key
from indexer.scans import (
    AFTER_PREFIX,
    KeyRange,
    Row,
    column_names,
    iterate,
    json_text,
    splits,
)
from indexer.storage import IndexStore, StoredIndex, StoreError, StoreLockedError

FORMAT = "indexer"
DEFAULT_PARTITIONS = 4
DEFAULT_LEASE_S = 600.0
DEFAULT_TIMEOUT_S = 120.0
SNAPSHOTS = ("persisted", "stable")
OPTIONS = (
    "url path cluster_map index partitions snapshot consistency at_plus pin lease_s timeout "
    "pushdown token token_file tls tls_ca"
)
JSON_TEXT = "indexer.json_text"  # field metadata marking a column of JSON text (the default)
OFFLINE_CHUNK_ROWS = 100_000  # rows read per hold of an offline store's lock
BATCH_ROWS = 16_384  # rows per Arrow record batch built offline
PLANNING_LOCK_WAIT_S = 3.0  # how long planning waits for an offline store held by another reader
MAX_PLANNING_THREADS = 32  # nodes asked at once while planning a read over a cluster map
# The JVM class whose private field `readInfo` tells that Spark keeps the read plan per scan
PYTHON_SCAN_BUILDER = "org.apache.spark.sql.execution.datasources.v2.python.PythonScanBuilder"

log = logging.getLogger(__name__)


class IndexerSourceError(Exception):
    """The source cannot read: bad options, the daemon said no, the store is held. One line."""


def _access(opts: Mapping[str, str]) -> Access:
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


# ---------------------------------------------------------------------------------------------
# Options


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
        cluster_map = opts.get("cluster_map") or None
        if sum(x is not None for x in (url, path, cluster_map)) != 1:
            raise IndexerSourceError(
                'give exactly one of .option("url", "http://HOST:PORT") (a running daemon), '
                '.option("path", DATA_DIR) (a stopped node\'s data directory) and '
                '.option("cluster_map", MAP_FILE) (every node of a cluster map)'
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
        access = _access(opts)
        if path is not None and access != Access():
            raise IndexerSourceError(
                "offline reads (path) open the store itself: token, token_file, tls and tls_ca "
                "are for the url or cluster_map option"
            )
        pushdown = opts.get("pushdown", str(default_pushdown)).lower()
        if pushdown not in ("true", "false"):
            raise IndexerSourceError(f'pushdown: "true" or "false", not {pushdown!r}')
        return cls(
            index=index,
            url=url.rstrip("/") if url else None,
            path=path,
            cluster_map=cluster_map,
            partitions=_whole(opts, "partitions", 1, 10_000),
            snapshot=snapshot,
            at_plus=at_plus,
            pin=pin,
            lease_s=_positive(opts, "lease_s", DEFAULT_LEASE_S),
            timeout=_positive(opts, "timeout", DEFAULT_TIMEOUT_S),
            pushdown=pushdown == "true",
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


def _whole(opts: Mapping[str, str], name: str, low: int, high: int) -> int | None:
    if name not in opts:
        return None
    try:
        value = int(opts[name])
    except ValueError:
        raise IndexerSourceError(f"{name}: a whole number, not {opts[name]!r}") from None
    if not low <= value <= high:
        raise IndexerSourceError(f"{name}: from {low} to {high}, not {value}")
    return value


def _positive(opts: Mapping[str, str], name: str, default: float) -> float:
    if name not in opts:
        return default
    try:
        value = float(opts[name])
    except ValueError:
        raise IndexerSourceError(f"{name}: a number of seconds, not {opts[name]!r}") from None
    if not value > 0 or math.isinf(value):
        raise IndexerSourceError(f"{name}: a number of seconds above 0, not {opts[name]!r}")
    return value


# ---------------------------------------------------------------------------------------------
# The daemon's HTTP API (stdlib only: executors need nothing beyond pyarrow)


@dataclass(frozen=True)
class Pin:
    """A snapshot the daemon holds for readers until released or `lease_s` after pinning."""

    id: str
    snapshot: int
    seqno_sum: int
    lease_s: float
    url: str
    access: Access = dataclasses.field(default_factory=Access, repr=False)  # to release it


def _http(method: str, url: str, path: str, **kwargs: Any) -> Any:
    """`client.request`, its failure as the source's error."""
    try:
        return request(method, url, path, **kwargs)
    except ClientError as exc:
        raise IndexerSourceError(str(exc)) from None


def _json_call(method: str, url: str, path: str, **kwargs: Any) -> Any:
    with _http(method, url, path, **kwargs) as response:
        return json.loads(response.read())


def pin_snapshot(
    url: str,
    snapshot: str = "persisted",
    *,
    at_plus: Mapping[str, int] | None = None,
    lease_s: float = DEFAULT_LEASE_S,
    timeout: float = DEFAULT_TIMEOUT_S,
    access: Access | None = None,
) -> Pin:
    """Pin the latest persisted (or "stable", or an at_plus) snapshot on the daemon at `url`."""
    url = url.rstrip("/")
    access = access or Access()
    body: dict[str, Any] = {"lease_s": lease_s}
    if at_plus is not None:
        body.update(at_plus=dict(at_plus), timeout_s=timeout)
    else:
        body.update(snapshot=snapshot, timeout_s=timeout)
    answer = _json_call(
        "POST", url, "/snapshots/pin", body=body, timeout=timeout + 10, access=access
    )
    return Pin(
        str(answer["id"]),
        int(answer["snapshot"]),
        int(answer["seqno_sum"]),
        float(answer["lease_s"]),
        url,
        access,
    )


def release(url: str, pin_id: str, timeout: float = 30, access: Access | None = None) -> None:
    """Release a pin; one already released or expired is fine."""
    with contextlib.suppress(IndexerSourceError):
        path = f"/snapshots/{pin_id}"
        _http("DELETE", url.rstrip("/"), path, timeout=timeout, access=access).close()


@contextlib.contextmanager
def pinned(
    url: str,
    snapshot: str = "persisted",
    *,
    at_plus: Mapping[str, int] | None = None,
    lease_s: float = DEFAULT_LEASE_S,
    timeout: float = DEFAULT_TIMEOUT_S,
    access: Access | None = None,
) -> Iterator[Pin]:
    """A pin for several reads (`.option("pin", pin.id)`), released on leaving the block."""
    pin = pin_snapshot(
        url, snapshot, at_plus=at_plus, lease_s=lease_s, timeout=timeout, access=access
    )
    try:
        yield pin
    finally:
        release(url, pin.id, access=access)


def index_keys(
    url: str, index: str, timeout: float = DEFAULT_TIMEOUT_S, access: Access | None = None
) -> list[str]:
    """The key paths of `index` on the daemon at `url`."""
    listing = _json_call("GET", url.rstrip("/"), "/indexes", timeout=timeout, access=access)
    listing = listing["indexes"]
    for item in listing:
        if item["name"] == index:
            return [str(k) for k in item["keys"]]
    known = ", ".join(sorted(i["name"] for i in listing)) or "none"
    raise IndexerSourceError(f"indexer at {url}: no index named {index!r} (indexes: {known})")


# ---------------------------------------------------------------------------------------------
# Several nodes: a cluster map's nodes each hold the entries of their vbuckets

_T = TypeVar("_T")


@dataclass(frozen=True)
class Target:
    """A daemon a read plans over: the `url` option's, or one node of a cluster map."""

    url: str
    node: str | None = None  # the node's name in the cluster map
    vbuckets: frozenset[int] | None = None  # the node's slice (None: every vbucket)
    access: Access = dataclasses.field(default_factory=Access, repr=False)

    def say(self, message: str) -> str:
        """`message` naming the node it is about, if it is one."""
        return message if self.node is None else f"node {self.node}: {message}"

    def at_plus(self, vector: Mapping[str, int] | None) -> dict[str, int] | None:
        """The part of an at_plus vector the node can reach: the seqnos of its own vbuckets
        (it never receives the others, so a snapshot of it would never cover them)."""
        if vector is None or self.vbuckets is None:
            return None if vector is None else dict(vector)
        return {vb: s for vb, s in vector.items() if int(vb) in self.vbuckets}


def load_cluster(path: str | Path) -> ClusterMap:
    """The cluster map in the file at `path`; IndexerSourceError if unreadable or inconsistent."""
    try:
        return load_cluster_map(Path(path))
    except ClusterMapError as exc:
        raise IndexerSourceError(f"cluster_map: {exc}") from None


def cluster_targets(
    cluster: ClusterMap, at_plus: Mapping[str, int] | None = None, access: Access | None = None
) -> list[Target]:
    """One target per node of the map, in the map's order (over HTTPS when `access.tls`);
    checks `at_plus` against it."""
    access = access or Access()
    for vb in at_plus or {}:
        if not (vb.isdigit() and int(vb) < cluster.num_vbuckets):
            raise IndexerSourceError(
                f"at_plus: vbucket {vb!r} is not one of the cluster map's vbuckets "
                f"(0-{cluster.num_vbuckets - 1})"
            )
    return [
        Target(n.base_url(access.tls), n.name, frozenset(n.vbuckets), access) for n in cluster.nodes
    ]


def _targets(options: SourceOptions) -> list[Target]:
    if options.cluster_map is not None:
        cluster = load_cluster(options.cluster_map)
        return cluster_targets(cluster, options.at_plus, options.access)
    assert options.url is not None
    return [Target(options.url, access=options.access)]


def _on_each(targets: Sequence[Target], work: Callable[[int, Target], _T]) -> list[_T | Exception]:
    """`work(i, target)` for every target, at once; each one's answer or error (one naming its
    node), in the targets' order."""

    def run(i: int) -> _T | Exception:
        try:
            return work(i, targets[i])
        except IndexerSourceError as exc:
            return IndexerSourceError(targets[i].say(str(exc)))
        except Exception as exc:  # a bug or an unexpected answer: raised by `_results`
            return exc

    if len(targets) == 1:
        return [run(0)]
    with ThreadPoolExecutor(min(len(targets), MAX_PLANNING_THREADS)) as pool:
        return list(pool.map(run, range(len(targets))))


def _failure(outcomes: Sequence[object]) -> Exception | None:
    """None if no outcome is an error; else one error saying every node's failure."""
    errors = [o for o in outcomes if isinstance(o, Exception)]
    if not errors:
        return None
    if all(isinstance(e, IndexerSourceError) for e in errors):
        return IndexerSourceError("; ".join(str(e) for e in errors))
    return next(e for e in errors if not isinstance(e, IndexerSourceError))


def _results(outcomes: list[_T | Exception]) -> list[_T]:
    """The answers of `_on_each`, or its errors raised as one."""
    failure = _failure(outcomes)
    if failure is not None:
        raise failure
    return [o for o in outcomes if not isinstance(o, Exception)]


def _pin_each(
    targets: Sequence[Target],
    snapshot: str,
    at_plus: Mapping[str, int] | None,
    lease_s: float,
    timeout: float,
) -> list[Pin]:
    """A pin on every target, made at once; if any fails, the others are released."""
    outcomes = _on_each(
        targets,
        lambda _, t: pin_snapshot(
            t.url,
            snapshot,
            at_plus=t.at_plus(at_plus),
            lease_s=lease_s,
            timeout=timeout,
            access=t.access,
        ),
    )
    failure = _failure(outcomes)
    if failure is not None:
        _release_each([o for o in outcomes if isinstance(o, Pin)])
        raise failure
    return [o for o in outcomes if isinstance(o, Pin)]


def _release_each(pins: Sequence[Pin]) -> None:
    for pin in pins:
        release(pin.url, pin.id, access=pin.access)


@dataclass(frozen=True)
class ClusterPin:
    """One pin per node of a cluster map: `.option("pin", pins.id)` reads at all of them."""

    pins: dict[str, Pin]  # by node name, in the map's order

    @property
    def id(self) -> str:
        """The `pin` option's value: a JSON object of one pin id per node."""
        return json.dumps({node: pin.id for node, pin in self.pins.items()})

    @property
    def seqno_sum(self) -> int:
        """The seqnos the pinned snapshots hold, over all nodes."""
        return sum(pin.seqno_sum for pin in self.pins.values())


def pin_cluster(
    cluster_map: str | Path,
    snapshot: str = "persisted",
    *,
    at_plus: Mapping[str, int] | None = None,
    lease_s: float = DEFAULT_LEASE_S,
    timeout: float = DEFAULT_TIMEOUT_S,
    access: Access | None = None,
) -> ClusterPin:
    """Pin a snapshot on every node of the map, as `pin_snapshot` does on one (an `at_plus`
    vector is cut to each node's vbuckets). If a node fails, the pins made are released."""
    cluster = load_cluster(cluster_map)
    vector = None if at_plus is None else {str(vb): s for vb, s in at_plus.items()}
    targets = cluster_targets(cluster, vector, access)
    pins = _pin_each(targets, snapshot, vector, lease_s, timeout)
    return ClusterPin({str(t.node): pin for t, pin in zip(targets, pins, strict=True)})


def release_cluster(pins: ClusterPin) -> None:
    """Release every node's pin; those already released or expired are fine."""
    _release_each(list(pins.pins.values()))


@contextlib.contextmanager
def pinned_cluster(
    cluster_map: str | Path,
    snapshot: str = "persisted",
    *,
    at_plus: Mapping[str, int] | None = None,
    lease_s: float = DEFAULT_LEASE_S,
    timeout: float = DEFAULT_TIMEOUT_S,
    access: Access | None = None,
) -> Iterator[ClusterPin]:
    """Pins on every node for several reads (`.option("pin", pins.id)` with `cluster_map`),
    released on leaving the block."""
    pins = pin_cluster(
        cluster_map, snapshot, at_plus=at_plus, lease_s=lease_s, timeout=timeout, access=access
    )
    try:
        yield pins
    finally:
        release_cluster(pins)


def _given_pins(pin: str, targets: Sequence[Target]) -> list[str]:
    """The `pin` option's pin id for each target: the id itself for one daemon, a JSON object
    naming every node of the map for a cluster."""
    if targets[0].node is None:
        return [pin]
    names = [str(t.node) for t in targets]
    try:
        given = json.loads(pin)
    except ValueError:
        given = None
    if (
        not isinstance(given, dict)
        or sorted(given) != sorted(names)
        or not all(isinstance(v, str) and v for v in given.values())
    ):
        raise IndexerSourceError(
            f'pin: with cluster_map, a JSON object of one pin id per node, {{"{names[0]}": '
            f'"PIN_ID", ...}}, naming every node of the map ({", ".join(names)}): '
            "pinned_cluster(...).id gives one"
        )
    return [given[name] for name in names]


def share_partitions(counts: Sequence[int], total: int) -> list[int]:
    """How many of `total` partitions each node gets: in proportion to its entries (`counts`),
    at least one each, so max(total, nodes) in all. Rounding goes to the nodes furthest from
    their exact share."""
    whole = sum(counts)
    quotas = [total * c / whole if whole else total / len(counts) for c in counts]
    shares = [max(1, math.floor(q)) for q in quotas]
    wanted = max(total, len(counts))
    while sum(shares) < wanted:  # short of its share: the node furthest below it gains one
        shares[max(range(len(shares)), key=lambda i: quotas[i] - shares[i])] += 1
    while sum(shares) > wanted:  # raised to one: the node furthest above its share gives one
        over = [i for i in range(len(shares)) if shares[i] > 1]
        shares[max(over, key=lambda i: shares[i] - quotas[i])] -= 1
    return shares


def index_keys_everywhere(
    targets: Sequence[Target], index: str, timeout: float = DEFAULT_TIMEOUT_S
) -> list[str]:
    """The key paths of `index`, which every target must define alike."""
    found = _results(_on_each(targets, lambda _, t: index_keys(t.url, index, timeout, t.access)))
    for target, keys in zip(targets, found, strict=True):
        if keys != found[0]:
            raise IndexerSourceError(
                f"index {index!r} has keys {found[0]} on node {targets[0].node} but {keys} on "
                f"node {target.node}: every node must define it alike"
            )
    return found[0]


# ---------------------------------------------------------------------------------------------
# Offline: a data directory no daemon holds


@dataclass(frozen=True)
class PersistedSnapshot:
    """The persisted snapshot recorded in a data directory's snapshot file."""

    seqno_sum: int
    persisted_at: float
    checksum: str  # of the file's bytes: a read fails if the file changes under it


def offline_snapshot(path: str | Path) -> PersistedSnapshot | None:
    """The data directory's persisted snapshot, or None if it never persisted one."""
    from indexer.snapshots import SNAPSHOT_FILE, SnapshotFileError, read_snapshot_file

    data_dir = Path(path)
    try:
        raw = (data_dir / SNAPSHOT_FILE).read_bytes()
        count = len(json.loads(raw)["seqnos"])  # the file says how many vbuckets it holds
        found = read_snapshot_file(data_dir, count)
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, SnapshotFileError) as exc:
        raise IndexerSourceError(f"{data_dir}: unreadable snapshot file: {exc}") from None
    if found is None:
        return None
    ts, when = found
    return PersistedSnapshot(ts.total, when, f"{zlib.crc32(raw):08x}")


def _open_store(path: str, wait_s: float, planning: bool = False) -> IndexStore:
    """Open the store, waiting up to `wait_s` while another reader process holds its lock.

    LevelDB lets one process open a database at a time, so Python workers reading partitions
    of the same store take turns: each holds it only while it reads a chunk of rows.
    """
    deadline = time.monotonic() + wait_s
    delay = 0.005
    while True:
        try:
            return IndexStore(Path(path), create=False)
        except StoreLockedError:
            if time.monotonic() >= deadline:
                if planning:
                    raise IndexerSourceError(
                        f"the store in {path} is held by another process (a running daemon?): "
                        'read through the daemon with .option("url", "http://HOST:HTTP_PORT") '
                        'instead of .option("path", ...)'
                    ) from None
                raise IndexerSourceError(
                    f"the store in {path} stayed held by another process for {wait_s:g} s "
                    "(a daemon started on it, or other readers are slow): raise the timeout "
                    "option or use the url option"
                ) from None
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 0.1)
        except StoreError as exc:
            raise IndexerSourceError(str(exc)) from None


def _offline_keys(path: str, index: str) -> list[str]:
    store = _open_store(path, PLANNING_LOCK_WAIT_S, planning=True)
    try:
        return list(_stored_index(store, index).definition.keys)
    finally:
        store.close()


def _stored_index(store: IndexStore, index: str) -> StoredIndex:
    try:
        return store.index(index)
    except StoreError as exc:
        raise IndexerSourceError(str(exc)) from None


# ---------------------------------------------------------------------------------------------
# Columns and conversions


@dataclass(frozen=True)
class Column:
    """One output column: where its value comes from and how it is converted."""

    name: str
    position: int  # -1: the document id, else the key component
    path: str  # the key path ("" for the id)
    kind: str  # "id", "json" (JSON text), or a converted kind: string, boolean, integral, ...
    arrow: Any  # the pyarrow type Spark expects


_INT_BITS = {"byte": 8, "short": 16, "integer": 32, "long": 64}
_KINDS: dict[type[DataType], str] = {
    StringType: "string",
    BooleanType: "boolean",
    ByteType: "byte",
    ShortType: "short",
    IntegerType: "integer",
    LongType: "long",
    FloatType: "float",
    DoubleType: "double",
}
_NUMERIC = ("byte", "short", "integer", "long", "float", "double")


def default_schema(keys: Sequence[str]) -> StructType:
    """`id` then one STRING column of JSON text per key path (dots become underscores)."""
    names = _key_column_names(keys)
    fields = [StructField("id", StringType(), False)]
    fields += [StructField(n, StringType(), True, metadata={JSON_TEXT: True}) for n in names]
    return StructType(fields)


def _key_column_names(keys: Sequence[str]) -> list[str]:
    names = column_names(keys)
    if len(set(names)) != len(names) or "id" in names:
        raise IndexerSourceError(
            f"key paths {list(keys)} give clashing column names {names} (or one named id)"
        )
    return names


def plan_columns(schema: StructType, keys: Sequence[str]) -> list[Column]:
    """Map each field of the read schema to the id or a key component, checking its type."""
    from pyspark.sql.pandas.types import to_arrow_type

    names = _key_column_names(keys)
    out = []
    for field in schema.fields:
        arrow = to_arrow_type(field.dataType, timezone="UTC")
        if field.name == "id":
            if not isinstance(field.dataType, StringType):
                given = field.dataType.simpleString()
                raise IndexerSourceError(f"column id is a STRING, not {given}")
            out.append(Column("id", -1, "", "id", arrow))
            continue
        if field.name not in names:
            raise IndexerSourceError(
                f"no column {field.name!r} in the index: its columns are id, {', '.join(names)}"
            )
        position = names.index(field.name)
        if field.metadata.get(JSON_TEXT) and isinstance(field.dataType, StringType):
            kind = "json"
        else:
            found = _KINDS.get(type(field.dataType))
            if found is None:
                supported = "STRING, BOOLEAN, TINYINT, SMALLINT, INT, BIGINT, FLOAT, DOUBLE"
                raise IndexerSourceError(
                    f"column {field.name}: {field.dataType.simpleString()} is not supported "
                    f"({supported})"
                )
            kind = found
        out.append(Column(field.name, position, keys[position], kind, arrow))
    return out


def convert(kind: str, value: Any) -> Any:
    """A JSON value as a column of `kind` holds it; None when it does not fit."""
    if value is MISSING or value is None:
        return None
    if kind == "json":
        return json_text(value)
    if kind == "string":
        return value if isinstance(value, str) else None
    if kind == "boolean":
        return value if isinstance(value, bool) else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if kind == "double":
        return float(value)
    if kind == "float":
        try:
            return struct.unpack("f", struct.pack("f", value))[0]
        except (OverflowError, struct.error):
            return None
    if isinstance(value, float):
        if not value.is_integer():
            return None
        value = int(value)
    bits = _INT_BITS[kind]
    return value if -(1 << (bits - 1)) <= value < (1 << (bits - 1)) else None


# ---------------------------------------------------------------------------------------------
# Filter pushdown: a key range that holds every matching row, then the exact test on each batch

_OPS: dict[type[Filter], str] = {
    EqualTo: "eq",
    GreaterThan: "gt",
    GreaterThanOrEqual: "ge",
    LessThan: "lt",
    LessThanOrEqual: "le",
}
_ARROW_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "eq": pc.equal,
    "gt": pc.greater,
    "ge": pc.greater_equal,
    "lt": pc.less,
    "le": pc.less_equal,
}


def _type_byte(value: Any) -> bytes:
    return encode_key([value])[:1]


# Encoded keys of one JSON type form one contiguous block (N1QL collation ranks the types).
_BLOCKS: dict[str, tuple[bytes, bytes]] = {
    "boolean": (_type_byte(False), _type_byte(0)),
    "number": (_type_byte(0), _type_byte("")),
    "string": (_type_byte(""), _type_byte([])),
}


def _literal_fits(kind: str, value: Any) -> bool:
    if kind in ("json", "string"):
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind in ("float", "double"):
        if isinstance(value, int):
            return abs(value) < 1 << 1023
        return isinstance(value, float) and math.isfinite(value)
    return isinstance(value, int) and kind in _INT_BITS


def accepts(column: Column, f: Filter) -> tuple[str, Any] | None:
    """The (op, literal) the reader applies for filter `f` on the leading key, or None."""
    if isinstance(f, IsNotNull):
        return ("notnull", None)
    op = _OPS.get(type(f))
    value: Any = getattr(f, "value", None)
    if op is None or not _literal_fits(column.kind, value):
        return None
    if column.kind == "json":
        # JSON text orders unlike the index (9 < 10 but "9" > "10"): equality only.
        if op != "eq":
            return None
        try:
            encode_key([json.loads(value)])
        except ValueError:  # not JSON, or not a key value (NaN): Spark finds no row either
            return None
    return (op, value)


def filter_range(kind: str, pushed: Sequence[tuple[str, Any]]) -> KeyRange:
    """Encoded bounds holding every entry whose leading value can pass all `pushed` filters."""
    if not pushed:
        return KeyRange()
    lows: list[bytes] = []
    highs: list[bytes] = []
    block = "number" if kind in _NUMERIC else kind
    if block in _BLOCKS:  # a converted column is null outside its JSON type: no match there
        lows.append(_BLOCKS[block][0])
        highs.append(_BLOCKS[block][1])
    for op, value in pushed:
        if op == "notnull":
            continue
        if block == "number":
            # A number encodes as 0x05 + its nearest double + a suffix, so the 9-byte prefix of
            # a double bounds every number rounding to it. FLOAT rounds coarser: widen by an ulp.
            low = high = float(value)
            if kind == "float":
                margin = max(abs(low) * 2.0**-23, 2.0**-149)
                low, high = low - margin, high + margin
            lo = encode_key([low])[:9]
            hi = encode_key([high])[:9] + AFTER_PREFIX
            if op in ("gt", "ge"):
                lows.append(lo)
            elif op in ("lt", "le"):
                highs.append(hi)
            else:
                lows.append(lo)
                highs.append(hi)
            continue
        p = encode_key([json.loads(value) if kind == "json" else value])
        if op == "eq":
            lows.append(p)
            highs.append(p + AFTER_PREFIX)
        elif op == "gt":
            lows.append(p + AFTER_PREFIX)
        elif op == "ge":
            lows.append(p)
        elif op == "lt":
            highs.append(p)
        else:
            highs.append(p + AFTER_PREFIX)
    return KeyRange(max(lows) if lows else None, min(highs) if highs else None)


def intersect(a: KeyRange, b: KeyRange) -> KeyRange | None:
    """The common part of two ranges, or None when it is empty."""
    starts = [s for s in (a.start, b.start) if s is not None]
    stops = [s for s in (a.stop, b.stop) if s is not None]
    start = max(starts) if starts else None
    stop = min(stops) if stops else None
    if start is not None and stop is not None and start >= stop:
        return None
    return KeyRange(start, stop)


def apply_filters(batch: Any, index: int, pushed: Sequence[tuple[str, Any]]) -> Any:
    """Rows of the batch whose column `index` passes every pushed filter, as Spark would say."""
    if not pushed or batch.num_rows == 0:
        return batch
    column = batch.column(index)
    mask = None
    for op, value in pushed:
        if op == "notnull":
            test = pc.is_valid(column)
        else:
            test = _ARROW_OPS[op](column, pa.scalar(value, type=column.type))
        mask = test if mask is None else pc.and_kleene(mask, test)
    return batch.filter(mask)  # null in the mask drops the row, like a SQL WHERE


# ---------------------------------------------------------------------------------------------
# The data source


class IndexerPartition(InputPartition):
    """One key range of the index, read at one snapshot (a pin, or the store as it is); with a
    cluster map, of one node (`url`, `node`), at that node's pin."""

    def __init__(
        self,
        number: int,
        start: bytes | None,
        stop: bytes | None,
        pin: str | None,
        snapshot_checksum: str | None = None,
        empty: bool = False,
        url: str | None = None,
        node: str | None = None,
    ) -> None:
        super().__init__(number)
        self.number = number
        self.start = start
        self.stop = stop
        self.pin = pin
        self.snapshot_checksum = snapshot_checksum
        self.empty = empty
        self.url = url  # the daemon to read (None: the url option's)
        self.node = node  # its name in the cluster map


class IndexerDataSource(DataSource):
    """`spark.read.format("indexer")`: options url, path or cluster_map, index, partitions,
    snapshot, at_plus, pin, lease_s, timeout, pushdown (docs/spark.md), and token, token_file,
    tls, tls_ca for a daemon with a token or TLS (docs/security.md)."""

    default_partitions: int | None = None  # set by `register` to spark's default parallelism
    default_pushdown: bool = False  # set by `register`: on when the Spark keeps plans per scan
    default_pushdown_reason: str = "the source registered without register(): off"

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> StructType:
        options = SourceOptions.parse(self.options)
        return default_schema(_keys(options))

    def reader(self, schema: StructType) -> IndexerReader:
        options = SourceOptions.parse(self.options, self.default_pushdown)
        parts = options.partitions or self.default_partitions or DEFAULT_PARTITIONS
        return IndexerReader(options, schema, _keys(options), parts)


def _keys(options: SourceOptions) -> list[str]:
    if options.cluster_map is not None:
        return index_keys_everywhere(_targets(options), options.index, options.timeout)
    if options.url is not None:
        return index_keys(options.url, options.index, options.timeout, options.access)
    assert options.path is not None
    return _offline_keys(options.path, options.index)


class IndexerReader(DataSourceReader):
    """Plans partitions over one snapshot and reads each as Arrow record batches."""

    def __init__(
        self, options: SourceOptions, schema: StructType, keys: list[str], partitions: int
    ) -> None:
        from pyspark.sql.pandas.types import to_arrow_schema

        self.options = options
        self.keys = keys
        self.columns = plan_columns(schema, keys)
        self.arrow_schema = to_arrow_schema(schema, timezone="UTC")
        self.parts = partitions
        self.pushed: list[tuple[str, Any]] = []
        self.leading = next((i for i, c in enumerate(self.columns) if c.position == 0), None)

    def pushFilters(self, filters: list[Filter]) -> Iterable[Filter]:
        """Take the comparisons on the leading key column; hand every other filter back."""
        if not self.options.pushdown:
            yield from filters
            return
        for f in filters:
            taken = None
            if self.leading is not None:
                column = self.columns[self.leading]
                if getattr(f, "attribute", None) == (column.name,):
                    taken = accepts(column, f)
            if taken is None:
                yield f
            else:
                self.pushed.append(taken)

    def key_range(self) -> KeyRange | None:
        """What the pushed filters leave of the key space (None: nothing)."""
        if self.leading is None:
            return KeyRange()
        bounds = filter_range(self.columns[self.leading].kind, self.pushed)
        return intersect(bounds, KeyRange())

    def partitions(self) -> list[InputPartition]:
        """Pin the snapshot (on every node of a cluster map), split the index into ranges of
        about equal size, cut by filters."""
        wanted = self.key_range()
        if self.options.path is None:
            out = self._online_partitions(wanted)
            return out or [IndexerPartition(0, None, None, None, empty=True)]
        found = offline_snapshot(self.options.path)
        checksum = found.checksum if found else None
        ranges = self._offline_ranges() if wanted is not None else []
        out = []
        for r in ranges:
            cut = intersect(r, wanted or KeyRange())
            if cut is not None:
                out.append(IndexerPartition(len(out), cut.start, cut.stop, None, checksum))
        return out or [IndexerPartition(0, None, None, None, checksum, empty=True)]

    def _online_partitions(self, wanted: KeyRange | None) -> list[InputPartition]:
        """Pin (unless given) on each daemon, get its splits, cut them to `wanted`.

        One daemon gets `partitions` splits; the nodes of a cluster map share them out in
        proportion to their entries at their pins, at least one each. A pin the partitions do
        not use (the filters cut all of its node's ranges away) is released at once, and so is
        every pin made if planning fails; the others live out their lease (docs/spark.md).
        """
        options = self.options
        if wanted is None:  # the filters leave nothing: no pin, no partition to read
            return []
        targets = _targets(options)
        if options.pin is not None:
            pin_ids, made = _given_pins(options.pin, targets), []
        else:
            made = _pin_each(
                targets, options.snapshot, options.at_plus, options.lease_s, options.timeout
            )
            pin_ids = [pin.id for pin in made]
        try:
            if len(targets) == 1:
                shares = [self.parts]
            else:
                counts = _results(_on_each(targets, lambda i, t: self._count(t, pin_ids[i])))
                shares = share_partitions(counts, self.parts)
            ranges = _results(
                _on_each(targets, lambda i, t: self._splits(t, pin_ids[i], shares[i]))
            )
        except BaseException:
            _release_each(made)
            raise
        out: list[InputPartition] = []
        unused = []
        for i, target in enumerate(targets):
            before = len(out)
            for r in ranges[i]:
                cut = intersect(r, wanted)
                if cut is not None:
                    part = IndexerPartition(
                        len(out), cut.start, cut.stop, pin_ids[i], url=target.url, node=target.node
                    )
                    out.append(part)
            if len(out) == before and made:
                unused.append(made[i])
        _release_each(unused)
        return out

    def _count(self, target: Target, pin_id: str) -> int:
        """The index's entries on `target` at its pin."""
        path = f"/indexes/{self.options.index}/count"
        answer = _json_call(
            "GET",
            target.url,
            path,
            params={"pin": pin_id},
            timeout=self.options.timeout,
            access=target.access,
        )
        return int(answer["count"])

    def _splits(self, target: Target, pin_id: str, parts: int) -> list[KeyRange]:
        """`parts` key ranges of about equal entry counts on `target` at its pin."""
        answer = _json_call(
            "GET",
            target.url,
            f"/indexes/{self.options.index}/splits",
            params={"parts": parts, "pin": pin_id},
            timeout=self.options.timeout,
            access=target.access,
        )
        return [
            KeyRange(
                bytes.fromhex(s["start"]) if s["start"] else None,
                bytes.fromhex(s["stop"]) if s["stop"] else None,
            )
            for s in answer["splits"]
        ]

    def _offline_ranges(self) -> list[KeyRange]:
        """Splits of the index in the data directory, by a walk of its keys."""
        assert self.options.path is not None
        store = _open_store(self.options.path, PLANNING_LOCK_WAIT_S, planning=True)
        try:
            return splits(store, _stored_index(store, self.options.index), None, self.parts)
        finally:
            store.close()

    def read(self, partition: InputPartition) -> Iterator[Any]:
        """Arrow record batches of one partition, in index order."""
        if not isinstance(partition, IndexerPartition) or partition.empty:
            return
        if self.options.path is None:
            batches = self._read_online(partition)
        else:
            batches = self._read_offline(partition)
        for batch in batches:
            if self.leading is not None:
                batch = apply_filters(batch, self.leading, self.pushed)
            if batch.num_rows:
                yield batch

    # -- online

    def _read_online(self, part: IndexerPartition) -> Iterator[Any]:
        options = self.options
        url = part.url or options.url
        assert url is not None
        target = Target(url, part.node)
        params: dict[str, Any] = {"pin": part.pin}
        if part.start is not None:
            params["start"] = part.start.hex()
        if part.stop is not None:
            params["stop"] = part.stop.hex()
        path = f"/indexes/{options.index}/scan"
        try:
            response = _http(
                "GET",
                url,
                path,
                params=params,
                accept=ARROW_STREAM,
                timeout=options.timeout,
                access=options.access,
            )
        except IndexerSourceError as exc:
            if "no pin" in str(exc) and options.pin is None:
                raise IndexerSourceError(
                    target.say(
                        f"{exc}: a DataFrame reads the snapshot pinned when Spark planned it, "
                        f"for lease_s={options.lease_s:g} s: load it again, or raise lease_s"
                    )
                ) from None
            raise IndexerSourceError(target.say(str(exc))) from None
        with response:
            try:
                stream = pa.ipc.open_stream(response)
                for batch in stream:
                    yield self._from_server(batch)
            except (pa.ArrowInvalid, OSError, http.client.HTTPException) as exc:
                raise IndexerSourceError(
                    target.say(f"indexer at {url}: the scan stream broke off: {exc}")
                ) from None

    def _from_server(self, batch: Any) -> Any:
        """A server batch (id, JSON text per key path) as the read schema wants it."""
        arrays = []
        for column in self.columns:
            if column.kind == "id":
                array = batch.column("id")
            else:
                array = batch.column(column.path)
                if column.kind != "json":
                    values = [
                        None if t is None else convert(column.kind, json.loads(t))
                        for t in array.to_pylist()
                    ]
                    array = pa.array(values, type=column.arrow)
            if array.type != column.arrow:
                array = array.cast(column.arrow)
            arrays.append(array)
        return pa.RecordBatch.from_arrays(arrays, schema=self.arrow_schema)

    # -- offline

    def _read_offline(self, part: IndexerPartition) -> Iterator[Any]:
        """Read in chunks, holding the store's lock only while reading each chunk."""
        options = self.options
        assert options.path is not None
        start = part.start
        while True:
            store = _open_store(options.path, options.timeout)
            try:
                found = offline_snapshot(options.path)
                if (found.checksum if found else None) != part.snapshot_checksum:
                    raise IndexerSourceError(
                        f"the persisted snapshot in {options.path} changed during the read "
                        "(a daemon ran on it): read again"
                    )
                stored = _stored_index(store, options.index)
                bounds = KeyRange(start, part.stop)
                rows = list(islice(iterate(store, stored, None, bounds), OFFLINE_CHUNK_ROWS))
            finally:
                store.close()
            for i in range(0, len(rows), BATCH_ROWS):
                yield self._from_rows(rows[i : i + BATCH_ROWS])
            if len(rows) < OFFLINE_CHUNK_ROWS:
                return
            last = rows[-1]
            # The entry after the last one read: its exact bytes, then the smallest successor.
            start = encode_key(last.key) + last.docid.encode("utf-8") + b"\x00"

    def _from_rows(self, rows: Sequence[Row]) -> Any:
        arrays = []
        for column in self.columns:
            if column.kind == "id":
                values: list[Any] = [r.docid for r in rows]
            elif column.kind == "json":
                j = column.position
                values = [json_text(r.key[j]) for r in rows]
            else:
                j, kind = column.position, column.kind
                values = [convert(kind, r.key[j]) for r in rows]
            arrays.append(pa.array(values, type=column.arrow))
        return pa.RecordBatch.from_arrays(arrays, schema=self.arrow_schema)


def error_message(exc: BaseException) -> str:
    """The one line saying why a Spark action on this source failed (Spark wraps it deeply)."""
    text = str(exc)
    marker = f"{IndexerSourceError.__name__}: "
    for line in text.splitlines():
        if marker in line:
            return line.split(marker, 1)[1].strip()
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


# ---------------------------------------------------------------------------------------------
# Sessions

_LOG4J2 = """\
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
logger.hadoop.name = org.apache.hadoop.util.NativeCodeLoader
logger.hadoop.level = error
"""


def _under_spark_submit() -> bool:
    """True in a driver that spark-submit started (its JVM exists already)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def _is_local(master: str | None) -> bool:
    return master is None or master.startswith("local")


def configure(builder_or_conf: Any, master: str | None = None) -> Any:
    """Settings the source needs, on a `SparkSession.Builder` or a `SparkConf` (returned).

    Sets PYSPARK_PYTHON to this interpreter unless it is set (Python workers then import this
    package and its dependencies), turns on Python filter pushdown, hides the progress bar and,
    for a local master, binds to 127.0.0.1 (SPARK_LOCAL_IP) and keeps Spark's logs to warnings.
    Environment settings only matter before the session's JVM starts.
    """
    set_conf = getattr(builder_or_conf, "config", None) or builder_or_conf.set
    if "PYSPARK_PYTHON" not in os.environ:
        os.environ["PYSPARK_PYTHON"] = sys.executable
    set_conf("spark.sql.python.filterPushdown.enabled", "true")
    set_conf("spark.ui.showConsoleProgress", "false")
    if _is_local(master) and not _under_spark_submit():
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        log4j = _log4j_file()
        if log4j is not None and not _has_conf(builder_or_conf, "spark.driver.extraJavaOptions"):
            set_conf("spark.driver.extraJavaOptions", f"-Dlog4j.configurationFile=file:{log4j}")
    return builder_or_conf


def _log4j_file() -> Path | None:
    """A log4j2 configuration keeping Spark to warnings (None if it cannot be written)."""
    path = Path(tempfile.gettempdir()) / f"indexer-spark-log4j2-{os.getuid()}.properties"
    try:
        if not path.exists() or path.read_text() != _LOG4J2:
            path.write_text(_LOG4J2)
    except OSError:
        return None
    return path


def _has_conf(builder_or_conf: Any, key: str) -> bool:
    if hasattr(builder_or_conf, "contains"):  # a SparkConf
        return bool(builder_or_conf.contains(key))
    return key in getattr(builder_or_conf, "_options", {})  # a Builder keeps them there


def read_plan_per_scan(spark: SparkSession) -> bool:
    """True when the running Spark keeps the read plan made while pushing filters per scan
    (`PythonScanBuilder` has a `readInfo` field, SPARK-58551); False for Spark 4.3.0, which keeps
    it on the DataFrame's data source object (docs/spark.md). Raises when the JVM cannot be
    asked (Spark Connect has no gateway, an unknown Spark may lack the class)."""
    jvm: Any = spark._jvm
    fields = jvm.java.lang.Class.forName(PYTHON_SCAN_BUILDER).getDeclaredFields()
    return any(f.getName() == "readInfo" for f in fields)


def pushdown_default(
    spark: SparkSession, check: Callable[[SparkSession], bool] | None = None
) -> tuple[bool, str]:
    """The `pushdown` default for this session and why: on only when `check` (by default
    `read_plan_per_scan`) finds that Spark keeps the read plan per scan; off when Spark shares
    it or the check cannot run."""
    try:
        version = str(spark.version)
    except Exception:  # asks the JVM on a classic session
        version = "?"
    try:
        per_scan = bool((check or read_plan_per_scan)(spark))
    except Exception as exc:  # no JVM gateway (Spark Connect), class renamed, ...
        reason = f"could not tell how Spark {version} keeps read plans ({exc!r:.200})"
        return False, f"{reason}: off"
    if per_scan:
        return True, f"Spark {version} keeps the read plan per scan: on"
    return False, f"Spark {version} shares one read plan among a DataFrame's scans: off"


def register(spark: SparkSession) -> type[IndexerDataSource]:
    """Register the source as format "indexer", defaulting partitions to the parallelism and
    `pushdown` to what the running Spark allows (`pushdown_default`)."""
    parallelism = spark.sparkContext.defaultParallelism
    pushdown, reason = pushdown_default(spark)
    log.info("indexer source: pushdown default: %s", reason)
    # A subclass made here is pickled by value, defaults included, to the planning workers.
    defaults = {
        "default_partitions": parallelism,
        "default_pushdown": pushdown,
        "default_pushdown_reason": reason,
    }
    source = type("RegisteredIndexerDataSource", (IndexerDataSource,), defaults)
    spark.dataSource.register(source)
    return source


def session(
    app_name: str, master: str | None = None, log_level: str | None = "WARN"
) -> SparkSession:
    """A SparkSession ready for the source: configured, registered, local[*] by default.

    Under spark-submit the master comes from spark-submit unless `master` is given. `log_level`
    (None: leave it) applies once the session runs; lines logged while it starts are up to
    Spark's log4j2 configuration.
    """
    builder = SparkSession.builder.appName(app_name)
    if master is None and not _under_spark_submit():
        master = "local[*]"
    if master is not None:
        builder = builder.master(master)
    configure(builder, master)
    spark = builder.getOrCreate()
    if log_level is not None:
        spark.sparkContext.setLogLevel(log_level)
    register(spark)
    return spark

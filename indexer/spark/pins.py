"""The source's use of the daemon's API: pins of a snapshot on one node or on every node of a
cluster map, the index's keys, and the planning calls that go to every node at once."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from indexer.client import Access, ClientError, index_path, request
from indexer.cluster.map import ClusterMap, ClusterMapError, vbucket_ranges
from indexer.spark.options import (
    DEFAULT_LEASE_S,
    DEFAULT_TIMEOUT_S,
    IndexerSourceError,
    SourceOptions,
)

MAX_PLANNING_THREADS = 32  # nodes asked at once while planning a read over a cluster map


@dataclass(frozen=True)
class Pin:
    """A snapshot the daemon holds for readers until released or `lease_s` after pinning."""

    id: str
    snapshot: int
    seqno_sum: int
    lease_s: float
    url: str
    access: Access = dataclasses.field(default_factory=Access, repr=False)  # to release it
    cores: int | None = None  # the cores the daemon's process may run on (its scans share them)
    seqnos: tuple[int, ...] = ()  # the pinned snapshot's, one per vbucket


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
        int(answer["scan_cores"]) if "scan_cores" in answer else None,
        tuple(int(s) for s in answer.get("seqnos", ())),
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


def index_types(
    url: str,
    index: str,
    pin_id: str,
    timeout: float = DEFAULT_TIMEOUT_S,
    access: Access | None = None,
) -> list[set[str]]:
    """The JSON types each key position of `index` holds at the pinned snapshot."""
    answer = _json_call(
        "GET",
        url.rstrip("/"),
        index_path(index, "types"),
        params={"pin": pin_id},
        timeout=timeout,
        access=access,
    )
    return [set(types) for types in answer["types"]]


_T = TypeVar("_T")


@dataclass(frozen=True)
class Target:
    """A daemon a read plans over: the `url` option's, or one node of a cluster map."""

    url: str
    node: str | None = None  # the node's name in the cluster map
    vbuckets: frozenset[int] | None = None  # the node's slice (None: every vbucket)
    access: Access = dataclasses.field(default_factory=Access, repr=False)
    # Where the node holds other vbuckets too (replicas, moves): its slice, as a scan's
    # `vbuckets` parameter, so that its answers leave the others out.
    answers: str | None = None

    def say(self, message: str) -> str:
        """`message` naming the node it is about, if it is one."""
        return message if self.node is None else f"node {self.node}: {message}"

    def at_plus(self, vector: Mapping[str, int] | None) -> dict[str, int] | None:
        """The part of an at_plus vector the node can reach: the seqnos of its own vbuckets
        (it never receives the others, so a snapshot of it would never cover them)."""
        if vector is None or self.vbuckets is None:
            return None if vector is None else dict(vector)
        return vector_of(vector, self.vbuckets)


def vector_of(vector: Mapping[str, int], vbuckets: frozenset[int]) -> dict[str, int]:
    """The seqnos of `vbuckets` in an at_plus vector ({"vbucket": seqno, ...})."""
    return {vb: s for vb, s in vector.items() if int(vb) in vbuckets}


def load_cluster(path: str | Path) -> ClusterMap:
    """The cluster map in the file at `path`, or in etcd (`etcd://HOST:PORT/PREFIX`);
    IndexerSourceError if unreadable or inconsistent."""
    from indexer.cluster.store import load_map

    try:
        return load_map(path)
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
        Target(
            n.base_url(access.tls),
            n.name,
            frozenset(n.vbuckets),
            access,
            None if n.receives == n.vbuckets else ",".join(vbucket_ranges(n.vbuckets)),
        )
        for n in cluster.active_nodes
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

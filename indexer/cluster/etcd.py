"""etcd's v3 API over its JSON gateway (`POST /v3/kv/range`, `/v3/kv/txn`, `/v3/lease/*`,
`/v3/watch`), which every etcd since 3.3 serves on its client port.

The requests are plain dicts and the answers are parsed by pure functions (keys and values are
base64 in the gateway's JSON); `EtcdClient` sends them over httpx, which the project already uses,
trying each endpoint in turn. A gateway needs no gRPC stubs, whose Python packages for etcd
have not kept up with etcd or protobuf (python-etcd3's last release is from 2020)."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import httpx

ETCD_SCHEME = "etcd://"
_ENDPOINT = re.compile(r"^[A-Za-z0-9.\-]+:\d{1,5}$|^\[[0-9A-Fa-f:]+\]:\d{1,5}$")
_PREFIX = re.compile(r"^[A-Za-z0-9_\-./]+$")


class EtcdError(Exception):
    """etcd cannot be reached, or refused a request; the message says which and why."""


@dataclass(frozen=True)
class EtcdLocation:
    """Where a cluster lives: etcd's endpoints, and the key prefix of this cluster's keys."""

    endpoints: tuple[str, ...]  # http://HOST:PORT
    prefix: str  # "/indexer/prod": every key of the cluster starts with it

    @classmethod
    def parse(cls, text: str) -> EtcdLocation:
        """`etcd://HOST:PORT[,HOST:PORT...]/PREFIX`; ValueError with one line if it is not."""
        if not text.startswith(ETCD_SCHEME):
            raise ValueError(f"{text!r} is not etcd://HOST:PORT[,HOST:PORT...]/PREFIX")
        hosts, sep, prefix = text[len(ETCD_SCHEME) :].partition("/")
        endpoints = tuple(h for h in hosts.split(",") if h)
        if not endpoints or any(not _ENDPOINT.match(h) for h in endpoints):
            raise ValueError(f"{text!r}: the endpoints are HOST:PORT, comma-separated")
        prefix = prefix.strip("/")
        if not sep or not prefix or not _PREFIX.match(prefix):
            raise ValueError(
                f"{text!r}: a prefix of letters, digits, _ - . and / after the endpoints "
                "(etcd://127.0.0.1:2379/indexer)"
            )
        return cls(tuple(f"http://{h}" for h in endpoints), "/" + prefix)

    def key(self, *parts: str) -> bytes:
        return "/".join((self.prefix, *parts)).encode()

    def __str__(self) -> str:
        hosts = ",".join(e.removeprefix("http://") for e in self.endpoints)
        return f"{ETCD_SCHEME}{hosts}{self.prefix}"


class KeyValue(NamedTuple):
    key: bytes
    value: bytes
    mod_revision: int
    lease: int


# -- the requests and answers, as the gateway's JSON ------------------------------------------


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text or "")


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with `prefix` (etcd's range_end)."""
    stripped = prefix.rstrip(b"\xff")
    return stripped[:-1] + bytes([stripped[-1] + 1]) if stripped else b"\x00"


def range_request(key: bytes, prefix: bool = False) -> dict[str, Any]:
    body = {"key": _b64(key)}
    if prefix:
        body["range_end"] = _b64(prefix_end(key))
    return body


def put_request(key: bytes, value: bytes, lease: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        body["lease"] = str(lease)
    return body


def put_if_request(key: bytes, value: bytes, mod_revision: int) -> dict[str, Any]:
    """A transaction that puts `value` only if `key` was last changed at `mod_revision` (0: if
    it does not exist): how a change of the map never overwrites another one."""
    compare: dict[str, Any] = {"key": _b64(key), "result": "EQUAL"}
    if mod_revision:
        compare.update(target="MOD", mod_revision=str(mod_revision))
    else:
        compare.update(target="CREATE", create_revision="0")
    return {"compare": [compare], "success": [{"request_put": put_request(key, value)}]}


def key_values(body: dict[str, Any]) -> list[KeyValue]:
    return [
        KeyValue(
            _unb64(kv.get("key")),
            _unb64(kv.get("value")),
            int(kv.get("mod_revision", 0)),
            int(kv.get("lease", 0)),
        )
        for kv in body.get("kvs", [])
    ]


def revision(body: dict[str, Any]) -> int:
    return int(body.get("header", {}).get("revision", 0))


def watch_request(key: bytes, start_revision: int, prefix: bool = False) -> dict[str, Any]:
    create = range_request(key, prefix)
    if start_revision:
        create["start_revision"] = str(start_revision)
    return {"create_request": create}


class WatchEvent(NamedTuple):
    deleted: bool
    kv: KeyValue


def watch_events(line: str) -> tuple[int, list[WatchEvent]]:
    """One line of a watch's stream: the revision it is at, and its events."""
    try:
        result = json.loads(line)["result"]
    except (ValueError, KeyError, TypeError):
        raise EtcdError(f"etcd's watch sent {line[:200]!r}") from None
    if result.get("canceled"):
        raise EtcdError(f"etcd canceled the watch: {result.get('cancel_reason', 'no reason')}")
    events = [
        WatchEvent(event.get("type") == "DELETE", key_values({"kvs": [event["kv"]]})[0])
        for event in result.get("events", [])
    ]
    return revision(result), events


# -- over httpx --------------------------------------------------------------------------------


class EtcdClient:
    """Blocking calls to etcd (the CLI's, the Spark source's; a daemon's or a router's in a
    thread), each to the first endpoint that answers."""

    def __init__(self, location: EtcdLocation, timeout: float = 5.0) -> None:
        self.location = location
        plain = all(e.startswith("http://") for e in location.endpoints)  # no CA bundle to load
        self.http = httpx.Client(timeout=timeout, verify=not plain)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        failures = []
        for endpoint in self.location.endpoints:
            try:
                answer = self.http.post(f"{endpoint}/v3/{path}", json=body)
            except httpx.HTTPError as exc:
                failures.append(f"{endpoint}: {exc or type(exc).__name__}")
                continue
            return _answer(endpoint, path, answer)
        raise EtcdError(f"etcd cannot be reached ({'; '.join(failures)})")

    def get(self, key: bytes) -> tuple[KeyValue | None, int]:
        """The key's value (None if absent), and the store's revision."""
        body = self.call("kv/range", range_request(key))
        found = key_values(body)
        return (found[0] if found else None), revision(body)

    def get_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        body = self.call("kv/range", range_request(prefix, prefix=True))
        return key_values(body), revision(body)

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        return revision(self.call("kv/put", put_request(key, value, lease)))

    def put_if(self, key: bytes, value: bytes, mod_revision: int) -> bool:
        """Put only if the key is still at `mod_revision` (0: absent); whether it was."""
        return bool(self.call("kv/txn", put_if_request(key, value, mod_revision)).get("succeeded"))

    def delete(self, key: bytes) -> None:
        self.call("kv/deleterange", range_request(key))

    def grant(self, ttl_s: int) -> int:
        return int(self.call("lease/grant", {"TTL": str(ttl_s)})["ID"])

    def keep_alive(self, lease: int) -> int:
        """Renew a lease; the seconds it has left (0: it had expired)."""
        body = self.call("lease/keepalive", {"ID": str(lease)})
        return int(body.get("result", {}).get("TTL", 0))

    def time_to_live(self, lease: int) -> int:
        """The seconds a lease has left (-1: expired or unknown)."""
        return int(self.call("lease/timetolive", {"ID": str(lease)}).get("TTL", -1))

    def revoke(self, lease: int) -> None:
        self.call("lease/revoke", {"ID": str(lease)})


def _answer(endpoint: str, path: str, answer: httpx.Response) -> dict[str, Any]:
    try:
        body: dict[str, Any] = answer.json()
    except ValueError:
        body = {}
    if answer.status_code != 200 or "error" in body:
        why = body.get("error") or body.get("message") or answer.text[:200]
        raise EtcdError(f"etcd at {endpoint} refused {path}: HTTP {answer.status_code}: {why}")
    return body


async def watch(
    location: EtcdLocation, key: bytes, start_revision: int, prefix: bool = False
) -> AsyncIterator[tuple[int, list[WatchEvent]]]:
    """The changes of `key` (or of every key under it) from `start_revision` on, as etcd sends
    them (each with the revision it is at); ends with EtcdError when no endpoint answers."""
    failures: list[str] = []
    for endpoint in location.endpoints:
        try:
            # Plain HTTP needs no certificates: loading the CA bundle costs more than a watch.
            verify = not endpoint.startswith("http://")
            timeout = httpx.Timeout(5.0, read=None)
            async with httpx.AsyncClient(timeout=timeout, verify=verify) as client:
                body = watch_request(key, start_revision, prefix)
                async with client.stream("POST", f"{endpoint}/v3/watch", json=body) as answer:
                    if answer.status_code != 200:
                        raise EtcdError(
                            f"etcd at {endpoint} refused the watch: HTTP {answer.status_code}"
                        )
                    async for line in answer.aiter_lines():
                        if line.strip():
                            yield watch_events(line)
            return
        except httpx.HTTPError as exc:
            failures.append(f"{endpoint}: {exc or type(exc).__name__}")
    raise EtcdError(f"etcd cannot be reached for a watch ({'; '.join(failures)})")

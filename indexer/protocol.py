"""The router <-> indexer wire protocol as pure functions over bytes (sans-IO).

No sockets here: `encode` turns a message into a frame, `FrameDecoder` turns received bytes into
messages. Every frame is `length:u32 | version:u8 | type:u8 | payload`, big-endian, where length
counts the version, type and payload bytes. See docs/protocol.md for the full layout.
"""

from __future__ import annotations

import functools
import hmac
import json
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

VERSION = 1
DEFAULT_MAX_FRAME_BYTES = 1 << 20
MAX_FAILOVER_ENTRIES = 25  # entries kept per vbucket, as a KV failover table
MAX_TOKEN_CHARS = 4096  # a handshake token longer than this is refused before any comparison

_HEADER = struct.Struct(">IBB")
_VB_UUID = struct.Struct(">HQ")
_MARKER = struct.Struct(">HQQ")
_BATCH_HEADER = struct.Struct(">HIB")
_COUNT = struct.Struct(">I")
_POSITION = struct.Struct(">HQQ")
_COOKIE = struct.Struct(">Q")
_BARRIER_REPLY_HEAD = struct.Struct(">QB")
BARRIER_PERSISTED = 0x01
_ERROR = struct.Struct(">H")

OP_UPSERT = 1
OP_DELETE = 2
MAX_KEYS = 255


@functools.cache
def record_layout(nkeys: int) -> struct.Struct:
    """The fixed head of a record: length, seqno, op, docid length, one length per key.

    A record is `head | docid | key 1 | ... | key n`, so one unpack gives every offset.
    """
    return struct.Struct(">IQBH" + "I" * nkeys)


def queued_layout(nkeys: int) -> struct.Struct:
    """A record as queued: the same head without the leading length."""
    return struct.Struct(">QBH" + "I" * nkeys)


class MessageType(IntEnum):
    """The type byte of a frame."""

    HANDSHAKE = 1
    HANDSHAKE_REPLY = 2
    STREAM_BEGIN = 3
    STREAM_END = 4
    SNAPSHOT_MARKER = 5
    MUTATIONS = 6
    ACK = 7
    ERROR = 8
    BARRIER = 9
    BARRIER_REPLY = 10
    BUFFER_ACK = 11


class ErrorCode(IntEnum):
    """Codes of error frames; the indexer closes the connection after sending one."""

    PROTOCOL = 1  # malformed, truncated, unknown type or version
    FRAME_TOO_LARGE = 2
    NOT_MY_SLICE = 3  # a vbucket this node does not own
    STREAM_NOT_BEGUN = 4  # a marker or mutation for a vbucket without STREAM_BEGIN
    SEQNO_BACKWARDS = 5
    BAD_HANDSHAKE = 6
    STREAM_EXISTS = 7  # another connection streams this vbucket
    OUT_OF_SNAPSHOT = 8  # a mutation outside the current snapshot marker
    SHUTTING_DOWN = 9
    INTERNAL = 10
    BAD_MUTATION = 11  # a record that does not match the index definitions
    INDEXES_CHANGED = 12  # an index was created or dropped: handshake again for the new keys
    ROLLBACK = 13  # the index rolled back (another router's failover): handshake again
    BUILD_DONE = 14  # a build stream is no longer wanted (built, dropped): do not reconnect
    SLICE_CHANGED = 15  # this node's vbuckets changed (cluster map): handshake again
    UNAUTHORIZED = 16  # the handshake's token is missing or wrong (security.token)
    TOO_MANY_CONNECTIONS = 17  # the node has limits.max_feed_connections open already
    SOURCE_MISMATCH = 18  # the node indexes another source's history (Handshake.source)


PRIMARY_KEY = "META().id"
"""The one key of a primary index (indexer/expressions.py parses it)."""


class ProtocolError(Exception):
    """The peer sent bytes that break the protocol; `code` says how."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class IndexDefinition:
    """An index: a name, the key expressions whose values form its key (canonical text,
    indexer/expressions.py: field paths mostly), and for a partial index the condition (canonical
    text, indexer/where.py) a document must meet to be in it.
    """

    name: str
    keys: tuple[str, ...]
    where: str | None = None

    @property
    def array_key(self) -> int | None:
        """The position of the array key (several entries per document), or None."""
        for i, key in enumerate(self.keys):
            if key.startswith(("DISTINCT ARRAY ", "ALL ARRAY ")):
                return i
        return None

    @property
    def desc(self) -> tuple[bool, ...]:
        """Per key position, whether it is stored in descending order."""
        return tuple(key.endswith(" DESC") for key in self.keys)

    @property
    def primary(self) -> bool:
        """A primary index: every document, by its id (`META().id`)."""
        return self.keys == (PRIMARY_KEY,) and self.where is None


@dataclass(frozen=True, slots=True)
class VbucketPosition:
    """A point in one vbucket's history: the seqno reached and the vbuuid of that history."""

    vbucket: int
    seqno: int
    vbuuid: int


@dataclass(frozen=True, slots=True)
class Handshake:
    """Router -> indexer: who is speaking, which vbuckets it streams, and their histories.

    `failover_logs` maps a vbucket to its failover log: (vbuuid, seqno) entries, newest first,
    each the seqno at which that branch of history starts (UPR). A router that sends none is
    trusted never to reuse a seqno. With `flow_control` the router keeps at most the reply's
    `flow_control_bytes` unacknowledged and the indexer sends BUFFER_ACK as it takes frames.
    `token` is the shared secret of an indexer that requires one ("" = none); kept out of reprs.
    `source` is the identity of the router's history (its source log's UUID, as a Couchbase
    bucket UUID): a node indexes one source only. "" is the stateless feed's (`indexer feed`
    without a source log), which numbers documents after what the node holds.
    """

    router: str
    num_vbuckets: int
    vbuckets: tuple[int, ...]
    failover_logs: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    flow_control: bool = False
    # A build stream: the name of the build, its indexes' names joined by commas (one index, or
    # several built together); "" = maintenance.
    build: str = ""
    token: str = field(default="", repr=False)
    source: str = ""


STATELESS_SOURCE = "stateless"
"""The identity a node records for a handshake without `source`: the stateless feed's."""
MAX_SOURCE_CHARS = 64


def source_identity(handshake: Handshake) -> str:
    """The identity of the history a handshake's router streams (see Handshake.source)."""
    return handshake.source or STATELESS_SOURCE


def describe_source(identity: str) -> str:
    """A source identity as an operator reads it in one line."""
    if identity == STATELESS_SOURCE:
        return "the stateless feed's (indexer feed without --state)"
    return f"source log {identity}"


@dataclass(frozen=True, slots=True)
class HandshakeReply:
    """Indexer -> router: index definitions, owned vbuckets, and where to restart each stream."""

    indexes: tuple[IndexDefinition, ...]
    num_vbuckets: int
    owned: tuple[int, ...]
    restart: tuple[VbucketPosition, ...]
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    # vbucket -> seqno it was rolled back to at this handshake (its `restart` says the same).
    rollback: dict[int, int] = field(default_factory=dict)
    flow_control_bytes: int = 0  # the window, when the router asked for flow control
    # Builds running: the router opens one build stream per name (Handshake.build).
    builds: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class StreamBegin:
    vbucket: int
    vbuuid: int


@dataclass(frozen=True, slots=True)
class StreamEnd:
    vbucket: int
    vbuuid: int


@dataclass(frozen=True, slots=True)
class SnapshotMarker:
    """The mutations that follow, up to `end`, form one snapshot of the vbucket."""

    vbucket: int
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Mutation:
    """One document change: its key for every index (b'' = not in that index)."""

    seqno: int
    docid: bytes
    keys: tuple[bytes, ...]
    deleted: bool = False


@dataclass(frozen=True, slots=True)
class MutationBatch:
    """Mutations of one vbucket as they arrived: records stay bytes until a worker flushes them.

    `starts[i]`/`lengths[i]` locate record i inside `payload`; a record is what `parse_record`
    reads (seqno, op, docid and keys, without the leading length field).
    """

    vbucket: int
    nkeys: int
    payload: bytes
    seqnos: list[int]
    starts: list[int]
    lengths: list[int]

    def records(self) -> list[bytes]:
        """Each record as its own bytes object."""
        p = self.payload
        return [p[s : s + n] for s, n in zip(self.starts, self.lengths, strict=True)]

    def mutations(self) -> list[Mutation]:
        return [parse_record(r, self.nkeys) for r in self.records()]


@dataclass(frozen=True, slots=True)
class Ack:
    """Indexer -> router: everything at or below these positions is in a persisted snapshot."""

    positions: tuple[VbucketPosition, ...]


@dataclass(frozen=True, slots=True)
class Barrier:
    """Router -> indexer: answer `cookie` once everything sent before it is readable."""

    cookie: int


@dataclass(frozen=True, slots=True)
class BarrierReply:
    """Indexer -> router: every mutation sent before the barrier is in a readable snapshot.

    `positions` are the seqnos the connection had sent on each of its vbuckets (an `at_plus`
    vector for its reads); `persisted` says whether they are also in a persisted snapshot.
    """

    cookie: int
    persisted: bool
    positions: tuple[VbucketPosition, ...]


@dataclass(frozen=True, slots=True)
class BufferAck:
    """Indexer -> router: `nbytes` more of the flow-control window are free again."""

    nbytes: int


@dataclass(frozen=True, slots=True)
class Error:
    """Indexer -> router: why the connection is being closed."""

    code: ErrorCode
    message: str


Message = (
    Handshake
    | HandshakeReply
    | StreamBegin
    | StreamEnd
    | SnapshotMarker
    | MutationBatch
    | Ack
    | Barrier
    | BarrierReply
    | BufferAck
    | Error
)


# --------------------------------------------------------------------------------------------
# Encoding


def _frame(mtype: MessageType, payload: bytes) -> bytes:
    return _HEADER.pack(len(payload) + 2, VERSION, mtype) + payload


def encode_record(mutation: Mutation) -> bytes:
    """One mutation record of a MUTATIONS frame, with its leading length field."""
    return encode_record_of(mutation.seqno, mutation.docid, mutation.keys, mutation.deleted)


def encode_record_of(seqno: int, docid: bytes, keys: tuple[bytes, ...], deleted: bool) -> bytes:
    """`encode_record` of a mutation's fields: the streams make a record per document, and a
    frozen `Mutation` alone took twice the packing's time (1.3 against 0.7 us)."""
    layout = record_layout(len(keys))
    body = docid + b"".join(keys)
    op = OP_DELETE if deleted else OP_UPSERT
    lengths = [len(k) for k in keys]
    return layout.pack(layout.size - 4 + len(body), seqno, op, len(docid), *lengths) + body


def encode_mutations(vbucket: int, nkeys: int, records: Sequence[bytes]) -> bytes:
    """A MUTATIONS frame from records made by `encode_record`."""
    body = b"".join(records)
    return _frame(MessageType.MUTATIONS, _BATCH_HEADER.pack(vbucket, len(records), nkeys) + body)


def _positions(positions: Iterable[VbucketPosition]) -> bytes:
    items = [_POSITION.pack(p.vbucket, p.seqno, p.vbuuid) for p in positions]
    return _COUNT.pack(len(items)) + b"".join(items)


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _index_json(index: IndexDefinition) -> dict[str, Any]:
    out: dict[str, Any] = {"name": index.name, "keys": list(index.keys)}
    if index.where is not None:
        out["where"] = index.where
    return out


def encode(message: Message) -> bytes:
    """The frame of one message."""
    match message:
        case MutationBatch():
            records = [
                _COUNT.pack(n) + message.payload[s : s + n]
                for s, n in zip(message.starts, message.lengths, strict=True)
            ]
            return encode_mutations(message.vbucket, message.nkeys, records)
        case SnapshotMarker(vbucket, start, end):
            return _frame(MessageType.SNAPSHOT_MARKER, _MARKER.pack(vbucket, start, end))
        case StreamBegin(vbucket, vbuuid):
            return _frame(MessageType.STREAM_BEGIN, _VB_UUID.pack(vbucket, vbuuid))
        case StreamEnd(vbucket, vbuuid):
            return _frame(MessageType.STREAM_END, _VB_UUID.pack(vbucket, vbuuid))
        case Ack(positions):
            return _frame(MessageType.ACK, _positions(positions))
        case Barrier(cookie):
            return _frame(MessageType.BARRIER, _COOKIE.pack(cookie))
        case BarrierReply(cookie, persisted, positions):
            head = _BARRIER_REPLY_HEAD.pack(cookie, BARRIER_PERSISTED if persisted else 0)
            return _frame(MessageType.BARRIER_REPLY, head + _positions(positions))
        case BufferAck(nbytes):
            return _frame(MessageType.BUFFER_ACK, _COOKIE.pack(nbytes))
        case Error(code, text):
            return _frame(MessageType.ERROR, _ERROR.pack(code) + text.encode())
        case Handshake(
            router, num_vbuckets, vbuckets, failover_logs, flow_control, build, token, source
        ):
            body = {"router": router, "num_vbuckets": num_vbuckets, "vbuckets": list(vbuckets)}
            if source:
                body["source"] = source
            if flow_control:
                body["flow_control"] = True
            if build:
                body["build"] = build
            if token:  # absent when empty: the frame stays what daemons before tokens expect
                body["token"] = token
            if failover_logs:
                body["failover_logs"] = {
                    str(vb): [list(entry) for entry in log] for vb, log in failover_logs.items()
                }
            return _frame(MessageType.HANDSHAKE, _json(body))
        case HandshakeReply(
            indexes,
            num_vbuckets,
            owned,
            restart,
            max_frame_bytes,
            rollback,
            flow_control_bytes,
            builds,
        ):
            body = {
                "max_frame_bytes": max_frame_bytes,
                "indexes": [_index_json(i) for i in indexes],
                "num_vbuckets": num_vbuckets,
                "owned": list(owned),
                "restart": [[p.vbucket, p.seqno, p.vbuuid] for p in restart],
            }
            if rollback:
                body["rollback"] = {str(vb): seqno for vb, seqno in rollback.items()}
            if flow_control_bytes:
                body["flow_control_bytes"] = flow_control_bytes
            if builds:
                body["builds"] = list(builds)
            return _frame(MessageType.HANDSHAKE_REPLY, _json(body))
    raise TypeError(f"not a protocol message: {message!r}")


# --------------------------------------------------------------------------------------------
# Decoding


def parse_record(record: bytes, nkeys: int) -> Mutation:
    """A queued record (without its length field) back into a Mutation."""
    layout = queued_layout(nkeys)
    seqno, op, dlen, *lengths = layout.unpack_from(record, 0)
    pos = layout.size
    docid = record[pos : pos + dlen]
    pos += dlen
    keys = []
    for klen in lengths:
        keys.append(record[pos : pos + klen])
        pos += klen
    return Mutation(seqno, docid, tuple(keys), op == OP_DELETE)


def _decode_batch(payload: bytes) -> MutationBatch:
    if len(payload) < _BATCH_HEADER.size:
        raise ProtocolError(ErrorCode.PROTOCOL, "MUTATIONS frame shorter than its header")
    vbucket, count, nkeys = _BATCH_HEADER.unpack_from(payload, 0)
    layout = record_layout(nkeys)
    head = layout.size
    fixed = head - 4  # what a record's length counts besides docid and keys
    unpack = layout.unpack_from
    seqnos: list[int] = []
    starts: list[int] = []
    lengths: list[int] = []
    pos = _BATCH_HEADER.size
    end = len(payload)
    for i in range(count):
        if pos + head > end:
            raise ProtocolError(ErrorCode.PROTOCOL, f"MUTATIONS record {i} truncated")
        length, seqno, op, dlen, *klens = unpack(payload, pos)
        stop = pos + 4 + length
        if length != fixed + dlen + sum(klens) or stop > end:
            raise ProtocolError(ErrorCode.PROTOCOL, f"MUTATIONS record {i} has a bad length")
        if op != OP_UPSERT:
            if op != OP_DELETE:
                raise ProtocolError(ErrorCode.PROTOCOL, f"MUTATIONS record {i} has unknown op {op}")
            if any(klens):
                raise ProtocolError(ErrorCode.BAD_MUTATION, f"delete record {i} carries a key")
        if dlen == 0:
            raise ProtocolError(ErrorCode.BAD_MUTATION, f"MUTATIONS record {i} has an empty docid")
        seqnos.append(seqno)
        starts.append(pos + 4)
        lengths.append(length)
        pos = stop
    if pos != end:
        raise ProtocolError(ErrorCode.PROTOCOL, "MUTATIONS frame has bytes after its records")
    return MutationBatch(vbucket, nkeys, payload, seqnos, starts, lengths)


def _decode_positions(payload: bytes) -> tuple[VbucketPosition, ...]:
    (count,) = _COUNT.unpack_from(payload, 0)
    if len(payload) != 4 + count * _POSITION.size:
        raise ProtocolError(ErrorCode.PROTOCOL, "ACK frame length does not match its count")
    return tuple(VbucketPosition(*p) for p in _POSITION.iter_unpack(payload[4:]))


def _int_list(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise ProtocolError(ErrorCode.BAD_HANDSHAKE, f"{what} must be a list of integers")
    return tuple(value)


def _decode_json(payload: bytes) -> dict[str, Any]:
    try:
        body = json.loads(payload)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(ErrorCode.BAD_HANDSHAKE, f"handshake is not JSON: {exc}") from None
    except RecursionError:  # nested deeper than the parser goes, well within a frame
        raise ProtocolError(ErrorCode.BAD_HANDSHAKE, "handshake JSON is nested too deep") from None
    if not isinstance(body, dict):
        raise ProtocolError(ErrorCode.BAD_HANDSHAKE, "handshake must be a JSON object")
    return body


def _decode_handshake(payload: bytes) -> Handshake:
    body = _decode_json(payload)
    router = body.get("router", "")
    num = body.get("num_vbuckets")
    if not isinstance(router, str) or not isinstance(num, int) or isinstance(num, bool):
        raise ProtocolError(ErrorCode.BAD_HANDSHAKE, "handshake needs router and num_vbuckets")
    vbuckets = _int_list(body.get("vbuckets"), "vbuckets")
    flow_control = body.get("flow_control", False)
    if not isinstance(flow_control, bool):
        raise ProtocolError(ErrorCode.BAD_HANDSHAKE, "flow_control must be true or false")
    logs = _failover_logs(body.get("failover_logs", {}), num)
    build = body.get("build", "")
    if not isinstance(build, str):
        raise ProtocolError(ErrorCode.BAD_HANDSHAKE, "build must be an index name")
    token = body.get("token", "")
    if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS:
        raise ProtocolError(
            ErrorCode.BAD_HANDSHAKE,
            f"token must be a string of at most {MAX_TOKEN_CHARS} characters",
        )
    source = body.get("source", "")
    if not isinstance(source, str) or len(source) > MAX_SOURCE_CHARS:
        raise ProtocolError(
            ErrorCode.BAD_HANDSHAKE,
            f"source must be a string of at most {MAX_SOURCE_CHARS} characters",
        )
    return Handshake(router, num, vbuckets, logs, flow_control, build, token, source)


def token_matches(given: str, expected: str) -> bool:
    """Whether a presented token equals the expected one, in time independent of where they
    differ (hmac.compare_digest), so timing tells an attacker nothing."""
    return hmac.compare_digest(given.encode(), expected.encode())


def bearer_refusal(authorization: str, token: str) -> tuple[str, str] | None:
    """Why an HTTP `Authorization` header does not carry `token` as `Bearer TOKEN`, as
    (reason, RFC 6750 error code or ""), or None when it does. The daemon's and the router's
    HTTP APIs both check with it; the reason never holds the token."""
    scheme, _, presented = authorization.strip().partition(" ")
    presented = presented.strip()
    if not authorization:
        return "no Authorization header", ""
    if scheme.lower() != "bearer" or not presented:
        return "the Authorization header is not Bearer TOKEN", "invalid_request"
    if not token_matches(presented, token):
        return "the bearer token is wrong", "invalid_token"
    return None


def _failover_logs(value: Any, num_vbuckets: int) -> dict[int, tuple[tuple[int, int], ...]]:
    """{"vb": [[vbuuid, seqno], ...]}: u64 integers, at most MAX_FAILOVER_ENTRIES per vbucket."""
    if not isinstance(value, dict):
        raise ProtocolError(ErrorCode.BAD_HANDSHAKE, "failover_logs must be a JSON object")
    logs = {}
    for key, entries in value.items():
        # isascii: str.isdigit() also accepts digits such as "²" that int() refuses.
        if not (key.isascii() and key.isdigit()) or int(key) >= num_vbuckets:
            raise ProtocolError(
                ErrorCode.BAD_HANDSHAKE, f"failover_logs: {key!r} is not a vbucket number"
            )
        if not isinstance(entries, list) or not 1 <= len(entries) <= MAX_FAILOVER_ENTRIES:
            raise ProtocolError(
                ErrorCode.BAD_HANDSHAKE,
                f"failover_logs[{key}]: a list of 1 to {MAX_FAILOVER_ENTRIES} entries",
            )
        log = []
        for entry in entries:
            if not (
                isinstance(entry, list)
                and len(entry) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in entry)
                and all(0 <= v < 1 << 64 for v in entry)
            ):
                raise ProtocolError(
                    ErrorCode.BAD_HANDSHAKE,
                    f"failover_logs[{key}]: entries are [vbuuid, seqno] (u64 integers)",
                )
            log.append((entry[0], entry[1]))
        if any(log[i][1] < log[i + 1][1] for i in range(len(log) - 1)):
            raise ProtocolError(
                ErrorCode.BAD_HANDSHAKE,
                f"failover_logs[{key}]: newest entry first, seqnos never increasing",
            )
        logs[int(key)] = tuple(log)
    return logs


def _decode_index(item: Any) -> IndexDefinition:
    if not isinstance(item, dict):
        raise TypeError("an index must be a JSON object")
    where = item.get("where")
    if where is not None and not isinstance(where, str):
        raise TypeError(f"index {item.get('name')!r}: where must be a string")
    return IndexDefinition(item["name"], tuple(item["keys"]), where)


def _decode_handshake_reply(payload: bytes) -> HandshakeReply:
    body = _decode_json(payload)
    try:
        indexes = tuple(_decode_index(i) for i in body["indexes"])
        restart = tuple(VbucketPosition(int(v), int(s), int(u)) for v, s, u in body["restart"])
        return HandshakeReply(
            indexes,
            int(body["num_vbuckets"]),
            _int_list(body["owned"], "owned"),
            restart,
            int(body.get("max_frame_bytes", DEFAULT_MAX_FRAME_BYTES)),
            {int(vb): int(seqno) for vb, seqno in body.get("rollback", {}).items()},
            int(body.get("flow_control_bytes", 0)),
            tuple(str(name) for name in body.get("builds", ())),
        )
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        # OverflowError: int() of an infinite number (1e999 reads as inf).
        raise ProtocolError(ErrorCode.BAD_HANDSHAKE, f"bad handshake reply: {exc}") from None


def _fixed(payload: bytes, layout: struct.Struct, name: str) -> tuple[Any, ...]:
    if len(payload) != layout.size:
        raise ProtocolError(ErrorCode.PROTOCOL, f"{name} frame must be {layout.size} bytes")
    return layout.unpack(payload)


def decode_payload(mtype: int, payload: bytes) -> Message:
    """One frame's payload, given its type byte, as a message."""
    if mtype == MessageType.MUTATIONS:
        return _decode_batch(payload)
    if mtype == MessageType.SNAPSHOT_MARKER:
        return SnapshotMarker(*_fixed(payload, _MARKER, "SNAPSHOT_MARKER"))
    if mtype == MessageType.STREAM_BEGIN:
        return StreamBegin(*_fixed(payload, _VB_UUID, "STREAM_BEGIN"))
    if mtype == MessageType.STREAM_END:
        return StreamEnd(*_fixed(payload, _VB_UUID, "STREAM_END"))
    if mtype == MessageType.ACK:
        if len(payload) < 4:
            raise ProtocolError(ErrorCode.PROTOCOL, "ACK frame shorter than its count")
        return Ack(_decode_positions(payload))
    if mtype == MessageType.BARRIER:
        return Barrier(*_fixed(payload, _COOKIE, "BARRIER"))
    if mtype == MessageType.BUFFER_ACK:
        return BufferAck(*_fixed(payload, _COOKIE, "BUFFER_ACK"))
    if mtype == MessageType.BARRIER_REPLY:
        if len(payload) < _BARRIER_REPLY_HEAD.size + _COUNT.size:
            raise ProtocolError(ErrorCode.PROTOCOL, "BARRIER_REPLY frame shorter than its head")
        cookie, flags = _BARRIER_REPLY_HEAD.unpack_from(payload, 0)
        positions = _decode_positions(payload[_BARRIER_REPLY_HEAD.size :])
        return BarrierReply(cookie, bool(flags & BARRIER_PERSISTED), positions)
    if mtype == MessageType.ERROR:
        if len(payload) < 2:
            raise ProtocolError(ErrorCode.PROTOCOL, "ERROR frame shorter than its code")
        (code,) = _ERROR.unpack_from(payload, 0)
        try:
            error_code = ErrorCode(code)
        except ValueError:
            error_code = ErrorCode.INTERNAL
        return Error(error_code, payload[2:].decode(errors="replace"))
    if mtype == MessageType.HANDSHAKE:
        return _decode_handshake(payload)
    if mtype == MessageType.HANDSHAKE_REPLY:
        return _decode_handshake_reply(payload)
    raise ProtocolError(ErrorCode.PROTOCOL, f"unknown frame type {mtype}")


# A handshake lists every vbucket with its failover log (up to 25 entries each): a node whose
# frames are small (server.max_frame_bytes) must still take the handshakes of routers.
MAX_HANDSHAKE_BYTES = 2 << 20
_HANDSHAKES = frozenset({MessageType.HANDSHAKE, MessageType.HANDSHAKE_REPLY})


@dataclass
class FrameDecoder:
    """Collects received bytes and yields whole messages, h11-style.

    `feed()` stores bytes; `messages()` returns every complete message. A protocol error found
    after some good frames is raised on the following call, so the good frames before it are
    still delivered and nothing of the bad frame is. A frame whose header declares more than
    `max_frame_bytes` is refused from its 6-byte header alone: its payload is never collected,
    and once an error is found nothing more is buffered. Handshakes may take up to
    `MAX_HANDSHAKE_BYTES` whatever `max_frame_bytes` is.
    """

    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    _buffer: bytearray = field(default_factory=bytearray)
    _error: ProtocolError | None = None

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._error is None:  # after an error the connection is closing: keep nothing
            self._buffer += data

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def messages(self) -> list[Message]:
        if self._error is not None:
            raise self._error
        out: list[Message] = []
        buf = self._buffer
        # A frame's payload is copied out once, through a view: slicing the bytearray itself
        # made a bytearray, then bytes of it (two copies of every mutation).
        view = memoryview(buf)
        pos = 0
        end = len(buf)
        try:
            while end - pos >= _HEADER.size:
                length, version, mtype = _HEADER.unpack_from(buf, pos)
                limit = self.max_frame_bytes
                if mtype in _HANDSHAKES and limit < MAX_HANDSHAKE_BYTES:
                    limit = MAX_HANDSHAKE_BYTES
                if length > limit:
                    raise ProtocolError(
                        ErrorCode.FRAME_TOO_LARGE,
                        f"frame of {length} bytes exceeds the maximum of {limit}",
                    )
                if length < 2:
                    raise ProtocolError(ErrorCode.PROTOCOL, f"frame length {length} is too short")
                if version != VERSION:
                    raise ProtocolError(
                        ErrorCode.PROTOCOL, f"protocol version {version} is not {VERSION}"
                    )
                stop = pos + 4 + length
                if stop > end:
                    break
                out.append(decode_payload(mtype, view[pos + 6 : stop].tobytes()))
                pos = stop
        except ProtocolError as exc:
            self._error = exc
            pos = end
        except struct.error as exc:
            self._error = ProtocolError(ErrorCode.PROTOCOL, f"malformed frame: {exc}")
            pos = end
        finally:
            view.release()  # the bytearray cannot shrink while a view of it is held
        del buf[:pos]
        if not out and self._error is not None:
            raise self._error
        return out

    def close(self) -> None:
        """The peer closed its side: leftover bytes are a truncated frame."""
        if self._buffer and self._error is None:
            raise ProtocolError(
                ErrorCode.PROTOCOL, f"connection closed inside a frame ({len(self._buffer)} bytes)"
            )

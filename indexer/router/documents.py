"""Document sources of a router feed and the mapping of documents to vbuckets."""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import orjson

from indexer.keys import KeyEncodingError, encode_value


class DocumentError(ValueError):
    """A line of the input is not a document the feed understands."""


MAX_DEPTH = 128
"""Levels of arrays and objects an input document may nest: every value of such a document can
be an index key, whatever the index definitions are now or later."""

_EXACT_INT = 1 << 53  # every int up to this is exactly a double, and always a valid key


_LONG_DIGITS = re.compile(r"\d{19}")
# Every ASCII digit to "0", every other byte to " ": a run of 19 digits is then a plain `in`,
# five times faster than the regular expression on a line of the input.
_DIGITS_TO_ZEROS = bytes(48 if 48 <= i <= 57 else 32 for i in range(256))
_LONG_RUN = b"0" * 19
# The same with "[" and "{" to "[": one pass gives the run of digits and the nesting's bound.
_DIGITS_AND_OPENINGS = bytes(
    48 if 48 <= i <= 57 else 91 if i in (91, 123) else 32 for i in range(256)
)


def _has_long_digits(text: str | bytes) -> bool:
    """Whether the text holds 19 digits in a row: an integer orjson may not read exactly."""
    if isinstance(text, str):
        return _LONG_DIGITS.search(text) is not None
    return _LONG_RUN in text.translate(_DIGITS_TO_ZEROS)


def json_loads(text: str | bytes, **hooks: Any) -> Any:
    """Parse JSON as `json.loads` does, with orjson's speed where the two agree.

    orjson refuses some of what the standard library accepts (NaN, lone surrogates) and reads
    integers beyond 64 bits as floats: a text with a run of 19 digits, or one orjson refuses,
    goes to the standard library (with `hooks`, its parse_* arguments), so nothing parses
    differently.
    """
    if not _has_long_digits(text):
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass
    return json.loads(text, **hooks)


def _refuse_constant(name: str) -> Any:
    raise DocumentError(f"{name} is not a value an index key can hold (write null or a string)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise DocumentError(
            f"the number {text} is beyond a double, not a value an index key can hold"
        )
    return value


def _key_int(text: str) -> int:
    value = int(text)
    if -_EXACT_INT <= value <= _EXACT_INT:
        return value
    try:
        encode_value(value)
    except KeyEncodingError:
        raise DocumentError(
            f"the integer {text[:40]}{'...' if len(text) > 40 else ''} is beyond a double, "
            "not a value an index key can hold"
        ) from None
    return value


def depth_exceeds(value: Any, limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` levels deep in `value` (no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        if depth > limit:
            return True
        for child in children:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
    return False


def loads_document(text: str | bytes) -> Any:
    """Parse an input's JSON and refuse what no index key can hold (DocumentError): NaN,
    Infinity, a number beyond a double (1e400, a 400-digit integer), nesting over MAX_DEPTH.

    Anything in a document may become an index key later (a new index, a where), so the whole
    document is checked, not only today's index paths. orjson refuses NaN and infinities and
    reads at most 64-bit integers, so only the standard library's path needs the checks.
    """
    value = _loads_checked(text)
    nesting = (
        text.count("[") + text.count("{")
        if isinstance(text, str)
        else (text.count(b"[") + text.count(b"{"))
    )
    if nesting > MAX_DEPTH and isinstance(value, dict | list) and depth_exceeds(value, MAX_DEPTH):
        raise DocumentError(f"arrays and objects nest deeper than {MAX_DEPTH} levels")
    return value


def _loads_checked(text: str | bytes) -> Any:
    try:
        return json_loads(
            text, parse_constant=_refuse_constant, parse_float=_finite_float, parse_int=_key_int
        )
    except RecursionError:
        raise DocumentError(f"arrays and objects nest deeper than {MAX_DEPTH} levels") from None


_UNPARSED: Any = object()  # the body of a document read from its line only when asked for


class Document:
    """An upsert (`body` is the JSON object) or a delete (`body` is None) of one document.

    `line`: the JSONL line it was read from, if any; the source log stores that line as it is
    rather than encoding the document again (`id` may be a number there: read it with `str`).
    A document made by `from_line` parses its body only when something asks for it: an index
    on plain paths reads its keys from the line (`RecordEncoder`), so most documents are never
    held parsed.
    """

    __slots__ = ("_body", "_expires", "docid", "line")

    def __init__(self, docid: str, body: dict[str, Any] | None, line: bytes | None = None) -> None:
        self.docid = docid
        self.line = line
        self._body = body
        self._expires: bool | None = None

    @classmethod
    def from_line(cls, docid: str, line: bytes, expires: bool | None = None) -> Document:
        """The upsert a checked line in the JSONL shape holds, its body parsed on first use.
        `expires`: whether the body holds an `_exp`, if the caller knows (None: it does not)."""
        document = cls(docid, None, line)
        document._body = _UNPARSED
        document._expires = expires
        return document

    @property
    def body(self) -> dict[str, Any] | None:
        body = self._body
        if body is _UNPARSED:
            assert self.line is not None
            body = self._body = json_loads(self.line)["doc"]
        return body

    @property
    def deleted(self) -> bool:
        return self._body is None

    @property
    def has_expiry(self) -> bool:
        """Whether the body holds an `_exp` (indexer/router/expiry.py); an unparsed body is parsed
        only if its line could hold one (the key itself, or an escape that could spell it)."""
        body = self._body
        if body is None:
            return False
        if body is _UNPARSED:
            if self._expires is not None:
                return self._expires
            line = self.line
            assert line is not None
            if b"_exp" not in line and b"\\u" not in line:
                return False
        return "_exp" in self.body  # type: ignore[operator]  # not None: checked above

    @property
    def holds_body(self) -> bool:
        """Whether it is an upsert whose body is held parsed: worth keeping for the streams,
        where a line alone is as cheap to take again from the Mutation Manager's payload."""
        body = self._body
        return body is not None and body is not _UNPARSED

    @property
    def unparsed_line(self) -> bytes | None:
        """The line of an upsert whose body nothing has parsed yet (else None)."""
        return self.line if self._body is _UNPARSED else None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Document):
            return NotImplemented
        return self.docid == other.docid and self.body == other.body

    __hash__ = None  # type: ignore[assignment]  # a body is a dict

    def __repr__(self) -> str:
        return f"Document(docid={self.docid!r}, body={self.body!r})"

    def __getstate__(self) -> tuple[str, bytes | None, dict[str, Any] | None, bool, bool | None]:
        unparsed = self._body is _UNPARSED
        return (self.docid, self.line, None if unparsed else self._body, unparsed, self._expires)

    def __setstate__(
        self, state: tuple[str, bytes | None, dict[str, Any] | None, bool, bool | None]
    ) -> None:
        self.docid, self.line, body, unparsed, self._expires = state
        self._body = _UNPARSED if unparsed else body


def vbucket_of(docid: bytes, num_vbuckets: int) -> int:
    """The vbucket of a document: CRC32 of its id modulo the number of vbuckets."""
    return zlib.crc32(docid) % num_vbuckets


def parse_line(line: str, where: str, raw: bytes | None = None) -> Document:
    """One JSONL line: {"id": ..., "doc": {...}} or {"id": ..., "deleted": true}.

    `raw`: the line's bytes, kept in the document for the source log (and parsed: bytes are
    checked faster than text).
    """
    try:
        item = loads_document(line if raw is None else raw)
    except DocumentError as exc:
        raise DocumentError(f"{where}: {exc}") from None
    except ValueError as exc:
        raise DocumentError(f"{where}: not JSON: {exc}") from None
    if not isinstance(item, dict) or "id" not in item:
        raise DocumentError(f'{where}: expected an object with "id"')
    docid = item["id"]
    if isinstance(docid, bool) or not isinstance(docid, str | int) or docid == "":
        raise DocumentError(f"{where}: id must be a non-empty string or an integer")
    docid = str(docid)
    if len(docid.encode()) > 250:
        raise DocumentError(f"{where}: id longer than 250 bytes")
    if item.get("deleted") is True:
        return Document(docid, None, raw)
    body = item.get("doc")
    if not isinstance(body, dict):
        raise DocumentError(f'{where}: expected "doc": {{...}} or "deleted": true')
    return Document(docid, body, raw)


_MAX_ID_CHARS = 250 // 4  # an id of at most this many characters is at most 250 bytes


def quick_document(raw: bytes) -> Document | None:
    """The document of a stripped input line that needs none of `parse_line`'s slower paths
    (the common case), or None: then `parse_line` reads it, or says what is wrong with it.

    The same checks as `parse_line` with bytes, in one function: no integer orjson could misread,
    an object, nesting counted only where it could be deep, an id of at most 250 bytes, and no
    `_exp` (its check is the caller's slower path).
    """
    shape = raw.translate(_DIGITS_AND_OPENINGS)
    if _LONG_RUN in shape or shape.count(b"[") > MAX_DEPTH:
        return None
    try:
        item = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if type(item) is not dict:
        return None
    docid = item.get("id")
    if type(docid) is str:
        if not docid or (len(docid) > _MAX_ID_CHARS and len(docid.encode()) > 250):
            return None
    elif type(docid) is int:
        docid = str(docid)
    else:
        return None
    if item.get("deleted") is True:
        return Document(docid, None, raw)
    body = item.get("doc")
    if type(body) is not dict or "_exp" in body:
        return None
    # The parse above is dropped (it was a check): a parsed document held costs several times
    # its parse, and the streams read the index paths from the line.
    return Document.from_line(docid, raw, expires=False)


def encode_document(document: Document) -> bytes:
    """A document as compact JSON, in the JSONL input's shape."""
    item: dict[str, Any] = (
        {"id": document.docid, "deleted": True}
        if document.deleted
        else {"id": document.docid, "doc": document.body}
    )
    return json.dumps(item, separators=(",", ":"), ensure_ascii=False).encode()


# What a stored document says before its body: its id, and whether it is a delete.
_HEAD: Any = msgspec.json.Decoder(
    msgspec.defstruct("StoredHead", [("id", Any), ("deleted", Any, False)], gc=False)
)


def decode_document(value: bytes) -> Document:
    """A stored document: `encode_document`'s output, or an input line stored as it was read.
    Its body is parsed only if something reads it (the log holds only lines checked whole)."""
    try:
        head = _HEAD.decode(value)
    except msgspec.DecodeError:
        # Not strict JSON: a NaN that a log written before the input checks holds, say.
        item = json_loads(value)
        return Document(str(item["id"]), None if item.get("deleted") is True else item["doc"])
    docid = head.id
    if type(docid) is not str:
        docid = str(docid)
    if head.deleted is True:
        return Document(docid, None)
    return Document.from_line(docid, value)


def read_jsonl(path: Path) -> Iterator[Document]:
    """Documents of a JSONL file in file order; blank lines are skipped."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DocumentError(f"{path}:{number}: not UTF-8") from None
            if line.strip():
                yield parse_line(line, f"{path}:{number}", raw.strip())


_ID_PREFIX = b'{"id":"'
_SPACED_PREFIX = b'{"id": "'  # as json.dumps writes it


def routing_id(line: bytes) -> bytes | None:
    """The document id of an input line, as `vbucket_of` takes it; None if the line has none
    (it is bad: whoever parses it in full reports why).

    A line that starts `{"id":"` (or `{"id": "`) with one "id" in it and no escape in the id is
    read without a parse (the router's own output, and most writers'); any other line is
    parsed, so the id is always the one `parse_line` finds.
    """
    at = 7 if line.startswith(_ID_PREFIX) else 8 if line.startswith(_SPACED_PREFIX) else 0
    if at:
        end = line.find(b'"', at)
        if end > at and line.find(b"\\", at, end) < 0 and line.count(b'"id"') == 1:
            return line[at:end]
    try:
        item = json_loads(line)
    except ValueError:
        return None
    docid = item.get("id") if isinstance(item, dict) else None
    if isinstance(docid, bool) or not isinstance(docid, str | int) or docid == "":
        return None
    return str(docid).encode()


class LineSplitter:
    """Bytes of an input in, its complete lines out; a partial last line waits for the rest.
    `offset` and `line`: the bytes and lines before the next line (from where it started)."""

    def __init__(self, offset: int = 0, line: int = 0) -> None:
        self.partial = b""
        self.offset = offset
        self.line = line

    def feed(self, data: bytes) -> list[bytes]:
        joined = self.partial + data if self.partial else data
        *lines, self.partial = joined.split(b"\n")
        self.offset += len(joined) - len(self.partial)
        self.line += len(lines)
        return lines

    def finish(self) -> list[bytes]:
        """At the end of an input that is not followed: the last line, if it has no newline."""
        lines = [self.partial] if self.partial else []
        self.offset += len(self.partial)
        self.line += len(lines)
        self.partial = b""
        return lines

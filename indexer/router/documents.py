"""Document sources of a router feed and the mapping of documents to vbuckets."""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson


class DocumentError(ValueError):
    """A line of the input is not a document the feed understands."""


_LONG_DIGITS = re.compile(r"\d{19}")
_LONG_DIGITS_BYTES = re.compile(rb"\d{19}")


def json_loads(text: str | bytes) -> Any:
    """Parse JSON as `json.loads` does, with orjson's speed where the two agree.

    orjson refuses some of what the standard library accepts (NaN, lone surrogates) and reads
    integers beyond 64 bits as floats: a text with a run of 19 digits, or one orjson refuses,
    goes to the standard library, so nothing parses differently.
    """
    long_digits = _LONG_DIGITS if isinstance(text, str) else _LONG_DIGITS_BYTES
    if long_digits.search(text) is None:  # type: ignore[arg-type]
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass
    return json.loads(text)


@dataclass(frozen=True, slots=True)
class Document:
    """An upsert (`body` is the JSON object) or a delete (`body` is None) of one document.

    `line`: the JSONL line it was read from, if any; the source log stores that line as it is
    rather than encoding the document again (`id` may be a number there: read it with `str`).
    """

    docid: str
    body: dict[str, Any] | None
    line: bytes | None = field(default=None, compare=False, repr=False)


def vbucket_of(docid: bytes, num_vbuckets: int) -> int:
    """The vbucket of a document: CRC32 of its id modulo the number of vbuckets."""
    return zlib.crc32(docid) % num_vbuckets


def parse_line(line: str, where: str, raw: bytes | None = None) -> Document:
    """One JSONL line: {"id": ..., "doc": {...}} or {"id": ..., "deleted": true}.

    `raw`: the line's bytes, kept in the document for the source log.
    """
    try:
        item = json_loads(line)
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


def read_jsonl(path: Path) -> Iterator[Document]:
    """Documents of a JSONL file in file order; blank lines are skipped."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                yield parse_line(line, f"{path}:{number}")

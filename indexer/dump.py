"""`indexer dump`: an index's entries, in index order, straight from a stopped node's store."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from indexer.keys import MISSING, split_entry
from indexer.scans import json_encode
from indexer.storage import IndexStore


def entry_json(values: list[Any], docid: bytes) -> dict[str, Any]:
    """One entry as printed: MISSING components are null, and listed by position in "missing"."""
    out: dict[str, Any] = {
        "key": [None if v is MISSING else v for v in values],
        "id": docid.decode("utf-8", errors="replace"),
    }
    missing = [i for i, v in enumerate(values) if v is MISSING]
    if missing:
        out["missing"] = missing
    return out


def dump_lines(data_dir: Path, name: str) -> Iterator[str]:
    """JSON lines of every entry of index `name` (key by collation, then id by bytes)."""
    with IndexStore(data_dir, create=False) as store:
        index = store.index(name)
        count = len(index.definition.keys)
        desc = index.definition.desc
        for entry in store.main_entries(index):
            values, docid = split_entry(entry, count, desc)
            yield json_encode(entry_json(values, docid))

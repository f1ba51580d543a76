"""The LevelDB store: the one module that touches plyvel.

One LevelDB database holds every index, so one WriteBatch applies a flush to all of them at once:

    b"i" + index id (u16) + encoded key + docid -> b""             main index, in key order
    b"r" + index id (u16) + docid               -> encoded key     back index
    b"\\x00meta:indexes"                         -> JSON             index names, ids and keys
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import plyvel

from indexer.protocol import IndexDefinition

STORE_DIR = "store"
_META_INDEXES = b"\x00meta:indexes"
_META_SYNC = b"\x00meta:sync"
_ID = struct.Struct(">H")


class StoreError(Exception):
    """The store cannot be opened or used; the message says why."""


class StoreLockedError(StoreError):
    """Another process (a running daemon) holds the store."""


@dataclass(frozen=True)
class StoredIndex:
    """An index as the store knows it: its definition and the prefixes of its entries."""

    definition: IndexDefinition
    index_id: int

    @property
    def main_prefix(self) -> bytes:
        return b"i" + _ID.pack(self.index_id)

    @property
    def back_prefix(self) -> bytes:
        return b"r" + _ID.pack(self.index_id)


def open_leveldb(path: Path, create: bool) -> Any:
    """A plyvel database, with lock and corruption errors turned into one clear line."""
    try:
        return plyvel.DB(str(path), create_if_missing=create)
    except plyvel.IOError as exc:
        if "lock" in str(exc).lower():
            raise StoreLockedError(
                f"the store in {path} is held by another process (a running daemon?)"
            ) from None
        raise StoreError(f"cannot open the store in {path}: {exc}") from None
    except plyvel.Error as exc:
        raise StoreError(f"cannot open the store in {path}: {exc}") from None


class IndexStore:
    """Main and back index of every index in one LevelDB database."""

    def __init__(self, data_dir: Path, create: bool = True) -> None:
        path = data_dir / STORE_DIR
        if not create and not path.is_dir():
            raise StoreError(f"no store in {data_dir}")
        if create:
            path.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.db = open_leveldb(path, create)
        self._indexes: dict[str, StoredIndex] = {}
        raw = self.db.get(_META_INDEXES)
        if raw is not None:
            for name, item in json.loads(raw).items():
                definition = IndexDefinition(name, tuple(item["keys"]))
                self._indexes[name] = StoredIndex(definition, int(item["id"]))

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> IndexStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def indexes(self) -> dict[str, StoredIndex]:
        return dict(self._indexes)

    def index(self, name: str) -> StoredIndex:
        try:
            return self._indexes[name]
        except KeyError:
            known = ", ".join(sorted(self._indexes)) or "none"
            raise StoreError(f"no index named {name!r} in the store (indexes: {known})") from None

    def ensure_indexes(self, definitions: Sequence[IndexDefinition]) -> list[StoredIndex]:
        """The stored form of each definition, registering new ones.

        An index whose key paths differ from the stored ones is an error: its entries would mix
        two definitions.
        """
        out = []
        changed = False
        for definition in definitions:
            stored = self._indexes.get(definition.name)
            if stored is None:
                next_id = max((s.index_id for s in self._indexes.values()), default=0) + 1
                stored = StoredIndex(definition, next_id)
                self._indexes[definition.name] = stored
                changed = True
            elif stored.definition.keys != definition.keys:
                raise StoreError(
                    f"index {definition.name!r} is stored with keys "
                    f"{list(stored.definition.keys)}, not {list(definition.keys)}; "
                    "use a new index name or a new data directory"
                )
            out.append(stored)
        if changed:
            meta = {
                s.definition.name: {"id": s.index_id, "keys": list(s.definition.keys)}
                for s in self._indexes.values()
            }
            self.db.put(_META_INDEXES, json.dumps(meta).encode(), sync=True)
        return out

    def write(self, puts: Sequence[tuple[bytes, bytes]], deletes: Sequence[bytes]) -> None:
        """Apply deletes then puts as one WriteBatch (blocking: call it from a worker thread)."""
        with self.db.write_batch() as batch:
            for key in deletes:
                batch.delete(key)
            for key, value in puts:
                batch.put(key, value)

    def write_batch(self) -> Any:
        """A plyvel WriteBatch; `write()` on it releases the GIL."""
        return self.db.write_batch()

    def sync(self) -> None:
        """Make every earlier write durable (a synchronous write syncs LevelDB's log)."""
        self.db.put(_META_SYNC, b"", sync=True)

    def get(self, key: bytes) -> bytes | None:
        value: bytes | None = self.db.get(key)
        return value

    def snapshot(self) -> Any:
        return self.db.snapshot()

    def back_entries(self, index: StoredIndex) -> Iterator[tuple[bytes, bytes]]:
        """(docid, encoded key) of every back-index entry of one index."""
        prefix = index.back_prefix
        cut = len(prefix)
        for key, value in self.db.iterator(prefix=prefix):
            yield key[cut:], value

    def main_entries(self, index: StoredIndex, snapshot: Any = None) -> Iterator[bytes]:
        """Main-index entries (encoded key + docid, prefix stripped) in index order."""
        prefix = index.main_prefix
        cut = len(prefix)
        source = snapshot if snapshot is not None else self.db
        for key in source.iterator(prefix=prefix, include_value=False):
            yield key[cut:]

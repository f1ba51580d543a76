"""The index catalog over HTTP: POST /indexes, GET and DELETE /indexes/NAME."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from indexer.catalog import CatalogError, IndexCatalog
from indexer.config import FIELD_PATH, INDEX_NAME, MAX_KEYS
from indexer.http.stats import StatsRoutes
from indexer.http.wire import ApiError, Send, _json
from indexer.protocol import IndexDefinition
from indexer.storage import StoredIndex
from indexer.where import WhereError, normalize_where


class AdminRoutes(StatsRoutes):
    """The index catalog over HTTP: create, describe and drop indexes."""

    def _catalog(self) -> IndexCatalog:
        if self.view.catalog is None:
            raise ApiError(503, "indexes cannot be changed now")
        return self.view.catalog

    async def _catalog_call(self, call: Awaitable[Any]) -> Any:
        try:
            return await call
        except CatalogError as exc:
            raise ApiError(exc.status, exc.message) from None

    async def create_index(self, body: dict[str, Any], send: Send) -> None:
        name = body.get("name")
        keys = body.get("keys")
        if not isinstance(name, str) or not INDEX_NAME.match(name):
            raise ApiError(400, "name: a letter, then up to 63 letters, digits or _")
        if not isinstance(keys, list) or not 1 <= len(keys) <= MAX_KEYS:
            raise ApiError(400, f"keys: a list of 1 to {MAX_KEYS} field paths")
        for path in keys:
            if not isinstance(path, str) or not FIELD_PATH.match(path):
                raise ApiError(400, f"keys: {path!r} is not a field path like address.zip")
        where = body.get("where")
        if where is not None:
            if not isinstance(where, str):
                raise ApiError(400, 'where: a condition as a string, like "age >= 18"')
            try:
                where = normalize_where(where)
            except WhereError as exc:
                raise ApiError(400, f"where: {exc}") from None
        unknown = set(body) - {"name", "keys", "where"}
        if unknown:
            raise ApiError(400, f"{sorted(unknown)[0]}: unknown member")
        definition = IndexDefinition(name, tuple(keys), where)
        catalog = self._catalog()
        stored = await self._catalog_call(catalog.create(definition))
        build = catalog.builds.get(name)
        entry = self._index_entry(stored, 0) if build is None else self._build_entry(build)
        await _json(send, 201, entry)

    def _index(self, name: str, query: dict[str, str] | None = None) -> StoredIndex:
        for index in self.view.indexes:
            if index.definition.name == name:
                return index
        build = self.view.catalog.builds.get(name) if self.view.catalog is not None else None
        if build is not None:
            status = build.status()
            if query is None or query.get("consistency", "any") != "any" or "at_plus" in query:
                raise ApiError(
                    409,
                    f"index {name!r} is {status.state} ({status.percent:g}% built): only "
                    "consistency=any reads it before it is active, and sees what is built so far",
                )
            return build.index
        raise ApiError(404, f"no index named {name!r}")

    async def index_details(self, name: str) -> dict[str, Any]:
        """GET /indexes/NAME: its entry of /indexes with its entry of /stats, or a 404."""
        if not any(i.definition.name == name for i in self._all_indexes()):
            raise ApiError(404, f"no index named {name!r}")
        await self.measure_disk()
        for entry in self.index_list():  # the index may have been dropped meanwhile
            if entry["name"] == name:
                return {**entry, **self.index_stats(name, entry["entries"])}
        raise ApiError(404, f"no index named {name!r}")

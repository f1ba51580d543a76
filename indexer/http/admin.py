"""The index catalog over HTTP: POST /indexes, GET and DELETE /indexes/NAME."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from indexer.catalog import CatalogError, IndexCatalog
from indexer.config import DefinitionError, check_index_name, index_definition
from indexer.http.stats import StatsRoutes
from indexer.http.wire import ApiError, Send, _json
from indexer.storage import StoredIndex


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
        # A state of the stored index, not part of its definition: taken out first.
        defer = body.pop("defer_build", False)
        if not isinstance(defer, bool):
            raise ApiError(400, "defer_build: true or false")
        unknown = set(body) - {"name", "keys", "where", "primary"}
        if unknown:
            raise ApiError(400, f"{sorted(unknown)[0]}: unknown member")
        try:
            definition = index_definition(
                body.get("name"), body.get("keys"), body.get("where"), body.get("primary")
            )
        except DefinitionError as exc:
            raise ApiError(400, str(exc)) from None
        catalog = self._catalog()
        stored = await self._catalog_call(catalog.create(definition, defer))
        await _json(send, 201, self._new_entry(catalog, stored))

    def _new_entry(self, catalog: IndexCatalog, stored: StoredIndex) -> dict[str, Any]:
        """The /indexes entry of an index just created or built: its build's while it has one."""
        name = stored.definition.name
        build = catalog.builds.get(name)
        return self._index_entry(stored, 0) if build is None else self._build_entry(build, name)

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
            return build.index(name)
        if any(i.definition.name == name for i in self._deferred()):
            raise ApiError(409, deferred_message(name))
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

    async def build_indexes(self, body: dict[str, Any], send: Send) -> None:
        """POST /indexes/_build {"indexes": [NAME, ...]}: build deferred indexes together, on
        one build stream; 202 with their entries of /indexes (200 when active at once)."""
        names = body.get("indexes")
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise ApiError(400, 'indexes: a list of deferred index names, like {"indexes": ["a"]}')
        unknown = set(body) - {"indexes"}
        if unknown:
            raise ApiError(400, f"{sorted(unknown)[0]}: unknown member")
        for name in names:
            problem = check_index_name(name)
            if problem is not None:
                raise ApiError(400, f"indexes: {problem}")
        catalog = self._catalog()
        built = await self._catalog_call(catalog.build(names))
        entries = [self._new_entry(catalog, stored) for stored in built]
        status = 200 if all(e["state"] == "active" for e in entries) else 202
        await _json(send, status, {"indexes": entries})


def deferred_message(name: str) -> str:
    """Why a deferred index cannot be read, and how to build it (one line)."""
    return (
        f"index {name!r} is deferred (created with defer_build): it holds nothing until built "
        f"with POST /indexes/_build or `indexer build-index {name}`"
    )

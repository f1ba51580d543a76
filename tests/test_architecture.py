"""The import rules of docs/architecture.md, checked on the source (an AST walk, no imports run):
no circles between modules, and each layer imports only what it may."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("indexer", "slab", "workers", "config")


def modules() -> dict[str, Path]:
    """Every module of the project by its dotted name (a package by its own name)."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = modules()


def imported(name: str) -> Iterator[str]:
    """Every module name `name` imports, anywhere in it (functions and TYPE_CHECKING blocks
    too), as written: third-party ones included."""
    tree = ast.parse(MODULES[name].read_text())
    is_package = MODULES[name].name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package
                package = name.split(".")[: len(name.split(".")) - node.level + is_package]
                base = ".".join([*package, *([base] if base else [])])
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def project_imports(name: str) -> set[str]:
    """The project's modules `name` imports (not itself)."""
    return {other for other in imported(name) if other in MODULES and other != name}


def test_no_module_imports_itself_back_through_others() -> None:
    graph = {name: project_imports(name) for name in MODULES}
    circles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for other in sorted(graph[name]):
            if state.get(other) == 1:
                circles.append([*path[path.index(other) :], other])
            elif other not in state:
                visit(other)
        path.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert circles == [], "import circles: " + "; ".join(" -> ".join(c) for c in circles)


@pytest.mark.parametrize(
    "codec",
    [
        "indexer.protocol",
        "indexer.keys",
        "indexer.grammar",
        "indexer.where",
        "indexer.expressions",
        "indexer.router.inputs.postgres.pgoutput",
        "indexer.router.inputs.postgres.pgtypes",
        "indexer.router.pipe",
        "indexer.router.shards.messages",
        "indexer.router.inputs.bulk",
        "indexer.router.inputs.lines",
    ],
)
def test_the_codecs_import_nothing_of_io_or_storage(codec: str) -> None:
    forbidden = ("trio", "plyvel", "socket", "ssl", "indexer.storage", "workers", "slab")
    found = {m for m in imported(codec) for f in forbidden if m == f or m.startswith(f + ".")}
    assert found == set(), f"{codec} imports {sorted(found)}"


# The router's rooms (docs/architecture.md): what each may import of the router. The basics
# (documents, expiry, the pipe codec) are everyone's; inputs write into the source, streams read
# from it, and neither knows the other; the service, its HTTP API and the shards put them together.
ROUTER_BASICS = ("indexer.router.documents", "indexer.router.expiry", "indexer.router.pipe")
ROUTER_ROOMS = {
    "indexer.router.source": ROUTER_BASICS,
    "indexer.router.inputs": (*ROUTER_BASICS, "indexer.router.source"),
    "indexer.router.streams": (*ROUTER_BASICS, "indexer.router.source"),
}


def _in(name: str, rooms: tuple[str, ...]) -> bool:
    return any(name == room or name.startswith(room + ".") for room in rooms)


@pytest.mark.parametrize("room", sorted(ROUTER_ROOMS))
def test_each_room_of_the_router_imports_only_what_it_may(room: str) -> None:
    members = [m for m in MODULES if _in(m, (room,))]
    assert members, f"no modules in {room}"
    allowed = (room, *ROUTER_ROOMS[room])
    for name in members:
        router = {m for m in project_imports(name) if _in(m, ("indexer.router",))}
        found = {m for m in router if not _in(m, allowed)}
        assert found == set(), f"{name} imports {sorted(found)}"


def test_the_basics_of_the_router_import_only_each_other() -> None:
    for name in ROUTER_BASICS:
        router = {m for m in project_imports(name) if _in(m, ("indexer.router",))}
        assert router <= set(ROUTER_BASICS), f"{name} imports {sorted(router)}"


def test_only_the_router_service_and_the_command_line_start_shards() -> None:
    outside = [
        name
        for name in MODULES
        if not _in(name, ("indexer.router.shards", "indexer.router.service", "indexer.cli"))
        and any(_in(m, ("indexer.router.shards",)) for m in project_imports(name))
    ]
    assert outside == []


def test_no_router_module_grows_past_its_one_job() -> None:
    """About 600 lines at most: a longer one holds two jobs (split it where they part)."""
    long = {
        name: n
        for name, path in MODULES.items()
        if _in(name, ("indexer.router",)) and (n := len(path.read_text().splitlines())) > 620
    }
    assert long == {}


def test_slab_imports_nothing_of_the_project() -> None:
    for name in (m for m in MODULES if m.split(".")[0] == "slab"):
        outside = {m for m in project_imports(name) if m.split(".")[0] != "slab"}
        assert outside == set(), f"{name} imports {sorted(outside)}"


def test_workers_know_nothing_of_http_or_scans() -> None:
    forbidden = ("indexer.http", "indexer.scans", "hypercorn", "httpx", "indexer.cluster")
    for name in (m for m in MODULES if m.split(".")[0] == "workers"):
        found = {m for m in imported(name) for f in forbidden if m == f or m.startswith(f + ".")}
        assert found == set(), f"{name} imports {sorted(found)}"


def test_the_spark_source_reaches_a_daemon_only_over_http_or_a_stopped_store() -> None:
    """No stage of a running daemon: the source reads over HTTP, or opens a store nobody runs."""
    stages = (
        "indexer.daemon", "indexer.reader", "indexer.streams", "indexer.dispatch",
        "indexer.timekeeper", "indexer.catalog", "indexer.rollback", "indexer.build",
        "indexer.http", "workers", "slab", "indexer.router",
    )  # fmt: skip
    spark = [m for m in MODULES if m == "indexer.spark" or m.startswith("indexer.spark.")]
    assert spark, "no Spark source found"
    for name in spark:
        found = {m for m in imported(name) for s in stages if m == s or m.startswith(s + ".")}
        assert found == set(), f"{name} imports {sorted(found)}"


def test_the_walk_finds_imports_in_functions_and_type_checking_blocks() -> None:
    """The rules are only as good as the walk: it sees lazy and typing-only imports."""
    assert "indexer.router.service" in project_imports("indexer.cli.feeds")  # inside a command
    assert any(m.startswith("indexer.") for m in project_imports("indexer.router.shards.parent"))

"""The PostgreSQL type matrix: one row per type and edge value (NULL, false, empty arrays, NaN,
infinities, extreme values), brought by the initial copy and then changed in the stream, and
inserted again through the stream. Each row's document must be the same on every path, and
equal to the README's table ("PostgreSQL types as JSON"), written out here by hand; the index
built from them must equal the model of those documents.

Real PostgreSQL, real router, real daemon; the documents are read back from the router's
source log once it has stopped.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from indexer.router.documents import Document
from indexer.router.source.log import SourceLog
from tests.e2e.conftest import WAIT_S, Daemon, free_port, model, write_config
from tests.e2e.test_postgres_source import dsn, pg, run, start_router  # noqa: F401 (fixture)
from tests.harness import Postgres, http

pytestmark = pytest.mark.e2e

# One client for the module's requests: a new one per call (httpx.get) builds its TLS
# context each time, which costs more than the request on a busy machine.
HTTP = http()  # the harness's client: no kept-alive connections

SCHEMA = """
CREATE DOMAIN posint AS integer CHECK (VALUE > 0);
CREATE DOMAIN flag AS boolean;
CREATE TYPE mood AS ENUM ('sad', 'happy');
CREATE TABLE typed (
    id text PRIMARY KEY,
    b boolean, i2 smallint, i4 integer, i8 bigint, num numeric, f4 real, f8 double precision,
    t text, vc varchar(10), ch char(5), u uuid,
    d date, tm time, ttz timetz, ts timestamp, tstz timestamptz, iv interval,
    j json, jb jsonb, by bytea, m mood, dom posint, fl flag,
    ia integer[], ta2 text[], ba boolean[], na numeric[], da posint[], ma mood[], jba jsonb[],
    fla flag[]
);
"""
COLUMNS = [
    "b", "i2", "i4", "i8", "num", "f4", "f8", "t", "vc", "ch", "u", "d", "tm", "ttz", "ts",
    "tstz", "iv", "j", "jb", "by", "m", "dom", "fl", "ia", "ta2", "ba", "na", "da", "ma", "jba",
    "fla",
]  # fmt: skip

# case -> {column: (SQL literal, the JSON value the README's table gives)}; others are NULL.
BIG = "1" + "0" * 400
CASES: dict[str, dict[str, tuple[str, Any]]] = {
    "nulls": {},
    "plain": {
        "b": ("true", True), "i2": ("1", 1), "i4": ("-42", -42), "i8": ("7", 7),
        "num": ("12.50", 12.5), "f4": ("1.1", 1.1), "f8": ("2.5", 2.5),
        "t": ("'héllo \"x\"'", 'héllo "x"'), "vc": ("'short'", "short"), "ch": ("'ab'", "ab   "),
        "u": ("'0E6F8D2A-0000-4000-8000-000000000000'", "0e6f8d2a-0000-4000-8000-000000000000"),
        "d": ("'2024-05-01'", "2024-05-01"), "tm": ("'10:00:00.5'", "10:00:00.5"),
        "ttz": ("'10:00:00+05:30'", "10:00:00+05:30"),
        "ts": ("'2024-05-01 10:00:00.25'", "2024-05-01T10:00:00.25"),
        "tstz": ("'2024-05-01 10:00:00.5+02'", "2024-05-01T08:00:00.5+00:00"),
        "iv": ("'1 year 2 months 3 days 04:05:06.5'", "P1Y2M3DT4H5M6.5S"),
        "j": ("'{\"a\": [1, 2.5, null], \"b\": \"x\"}'", {"a": [1, 2.5, None], "b": "x"}),
        "jb": ("'{\"k\": 3, \"t\": true}'", {"k": 3, "t": True}),
        "by": ("'\\x00ff10'::bytea", "\\x00ff10"), "m": ("'happy'", "happy"),
        "dom": ("5", 5), "fl": ("true", True),
        "ia": ("'{1,2,3}'", [1, 2, 3]), "ta2": ("'{{a,\"b c\"},{\"d,e\",NULL}}'",
                                               [["a", "b c"], ["d,e", None]]),
        "ba": ("'{t,f}'", [True, False]), "na": ("'{1.5,NaN,3}'", [1.5, "NaN", 3]),
        "da": ("'{1,NULL}'", [1, None]), "ma": ("'{sad,happy}'", ["sad", "happy"]),
        "jba": ("ARRAY['{\"a\": 1}'::jsonb, NULL]", [{"a": 1}, None]),
        "fla": ("'{t,NULL,f}'", [True, None, False]),
    },
    "false_and_zero": {
        "b": ("false", False), "i4": ("0", 0), "num": ("0", 0), "f8": ("'-0'", -0.0),
        "fl": ("false", False), "t": ("''", ""), "ia": ("'{}'", []), "ta2": ("'{}'", []),
        "j": ("'[]'", []), "jb": ("'{}'", {}), "by": ("''::bytea", "\\x"),
    },
    "extremes": {
        "i2": ("-32768", -32768), "i4": ("2147483647", 2147483647),
        "i8": ("-9223372036854775808", -9223372036854775808),
        "num": ("123456789012345678901234567890", 123456789012345678901234567890),
        "f4": ("3.4028235e38", 3.4028235e38),
        "f8": ("1.7976931348623157e308", 1.7976931348623157e308),
        "ts": ("'0044-03-15 12:00:00 BC'", "0044-03-15 12:00:00 BC"),
        "d": ("'infinity'", "infinity"), "tm": ("'24:00:00'", "24:00:00"),
        "tstz": ("'-infinity'", "-infinity"), "iv": ("'-1 day 02:00:00'", "P-1DT2H"),
        "ia": ("'[0:1]={5,6}'", [5, 6]),
        "ttz": ("'23:59:59.999999-12'", "23:59:59.999999-12:00"),
    },
    "not_numbers": {
        "num": ("'NaN'", "NaN"), "f4": ("'NaN'", "NaN"), "f8": ("'-Infinity'", "-Infinity"),
        "na": ("'{Infinity,-Infinity}'", ["Infinity", "-Infinity"]),
    },
    "beyond_a_double": {
        "num": (f"'{BIG}'", BIG),
        "jb": ("'{\"x\": 1e400, \"y\": 0.5}'", {"x": BIG, "y": 0.5}),
        "j": ("'{\"x\": 1e400}'", {"x": "1e400"}),
    },
}  # fmt: skip
INDEX = {"keys": ["b", "num", "tstz", "fl"]}


def insert(url: str, prefix: str) -> None:
    conn = psycopg2.connect(url)
    with conn, conn.cursor() as cur:
        for case, values in CASES.items():
            names = ["id", *values]
            literals = [f"'{prefix}{case}'", *(sql for sql, _ in values.values())]
            cur.execute(f"INSERT INTO typed ({', '.join(names)}) VALUES ({', '.join(literals)})")
    conn.close()


def expected(case: str) -> dict[str, Any]:
    values = CASES[case]
    return {column: values[column][1] if column in values else None for column in COLUMNS}


def same(a: Any, b: Any) -> bool:
    """Equal, with the same JSON types (1 is not 1.0, nor True), -0.0 not 0.0."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    return type(a) is type(b) and a == b


def versions(state: Path) -> dict[str, list[dict[str, Any] | None]]:
    """Every version of every document in the router's source log, in order."""
    out: dict[str, list[dict[str, Any] | None]] = {}
    with SourceLog(state, create=False) as log:
        for vb in log.vbuckets_with_history():
            for _, document in log.read(vb):
                out.setdefault(document.docid, []).append(document.body)
    return out


def test_every_type_is_the_same_document_on_the_copy_and_on_the_stream(
    pg: Postgres,  # noqa: F811 (the fixture)
    tmp_path: Path,
) -> None:
    pg.query("DROP DATABASE IF EXISTS types_matrix")
    pg.query("CREATE DATABASE types_matrix")
    url = dsn(pg, "types_matrix")
    run(url, SCHEMA)
    insert(url, "copy-")  # before the slot: the initial copy
    port = free_port()
    config = write_config(
        tmp_path / "indexer.toml", tmp_path / "data", port, **{"indexes.typed": INDEX}
    )
    daemon = Daemon(config, tmp_path / "daemon.log", port).start()
    router = start_router(tmp_path, daemon, url, "--table", "public.typed")
    router.wait_log(r"following public\.typed through slot")
    run(url, "UPDATE typed SET i2 = i2")  # every copied row again, now through the stream
    insert(url, "stream-")
    cases = len(CASES)
    deadline = time.monotonic() + WAIT_S
    while router.appended(HTTP) < 3 * cases:
        router.check_alive()
        assert time.monotonic() < deadline, router.appended(HTTP)
        time.sleep(0.1)
    # The index: the model of the documents the README's table gives.
    documents = [
        Document(f"{prefix}{case}", {"id": f"{prefix}{case}", **expected(case)})
        for case in CASES
        for prefix in ("copy-", "stream-")
    ]
    want = model(documents, INDEX["keys"])
    deadline = time.monotonic() + WAIT_S
    while True:
        answer = HTTP.get(f"{daemon.url}/indexes/typed/scan", timeout=60)
        assert answer.status_code == 200, answer.text
        got = [json.loads(line) for line in answer.text.splitlines() if line]
        if got == want:
            break
        assert time.monotonic() < deadline, (got, want)
        time.sleep(0.2)
    stats = router.stats(HTTP)["postgres"]
    assert stats["copied_rows"] == cases and stats["refused_rows"] == 0
    assert router.stop() == 0
    assert daemon.stop() == 0
    stored = versions(tmp_path / "state")
    wrong = {}
    for case in CASES:
        want_body = expected(case)
        copied, updated = stored[f"copy-{case}"]
        (streamed,) = stored[f"stream-{case}"]
        for path, body in (("copy", copied), ("update", updated), ("insert", streamed)):
            assert body is not None
            rest = {k: v for k, v in body.items() if k != "id"}
            if not same(rest, want_body):
                wrong[f"{case} ({path})"] = {
                    k: (rest.get(k), want_body[k])
                    for k in want_body
                    if not same(rest.get(k), want_body[k])
                }
    assert wrong == {}, wrong

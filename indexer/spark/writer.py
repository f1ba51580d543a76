"""The Spark writer: `df.write.format("indexer").option("router", URL).option("id", COLUMN)
.mode("append").save()` loads a DataFrame through the routers' `POST /docs/_bulk`.

Planning (the driver) checks the options and asks every router which vbuckets it owns: a peer
router (`--vbucket-range`) its range, a sharded router each shard's (and the shard's own address
when it is reachable the way the router is). Every task then turns its rows into input lines
(`rows.py`), groups them by the router that owns each document's vbucket, and posts them in
bounded bulks. A line the router refuses fails the task with that row's id and reason, or with
`on_error=skip` is counted and left out. Lines a router could not take for now (a shard
starting again, a router restarting) are sent again until `timeout`. A retried task sends its
rows again, which is harmless: the latest version of a document wins.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import time
import urllib.parse
import zlib
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyspark.sql.datasource import DataSourceArrowWriter, WriterCommitMessage

try:  # record batches to a stream writer: Spark 4.1 and newer
    from pyspark.sql.datasource import DataSourceStreamArrowWriter
except ImportError:  # pragma: no cover - depends on the installed Spark
    from pyspark.sql.datasource import (  # type: ignore[assignment]
        DataSourceStreamWriter as DataSourceStreamArrowWriter,
    )

from indexer.client import NDJSON, Access, ClientError, call_json, request
from indexer.spark.batch_lines import batch_lines
from indexer.spark.options import (
    IndexerSourceError,
    parse_access,
    seconds_option,
    whole_option,
)
from indexer.spark.rows import RowLine, RowShape, lines_of, rows_of

log = logging.getLogger("indexer.spark")

WRITE_OPTIONS = (
    "router id delete doc wait on_error nulls batch_rows batch_bytes timeout report token "
    "token_file tls tls_ca"
)
WAITS = ("persisted", "visible")
# A bulk is one append in the router, and each append costs it some work per vbucket it
# touches: 5,000-line bulks cost the router 33 us a document, 45,000-line ones 21 (as JSONL).
DEFAULT_BATCH_ROWS = 50_000
DEFAULT_BATCH_BYTES = 12 << 20  # under the router's default bulk limit of 16 MiB
DEFAULT_WRITE_TIMEOUT_S = 120.0
RETRY_MIN_S = 0.2
RETRY_MAX_S = 5.0
RETRY_STATUSES = (502, 503)  # and no answer at all
SKIPPED_SAMPLE = 5  # skipped rows whose reason a task keeps for the log
_REQUEST_LINE = re.compile(r"^line:\d+: ")  # how the router names a line of its request


@dataclass(frozen=True)
class WriterOptions:
    """The writer's options, checked once on the driver."""

    routers: tuple[str, ...]
    id_column: str
    delete_column: str | None = None
    doc_column: str | None = None
    wait: str = "persisted"
    skip_errors: bool = False
    keep_nulls: bool = False
    batch_rows: int = DEFAULT_BATCH_ROWS
    batch_bytes: int = DEFAULT_BATCH_BYTES
    timeout: float = DEFAULT_WRITE_TIMEOUT_S
    report: str | None = (
        None  # a file on the driver: the job's figures, written before save() returns
    )
    access: Access = field(default_factory=Access)

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> WriterOptions:
        opts = {k.lower(): v for k, v in options.items()}
        unknown = sorted(set(opts) - set(WRITE_OPTIONS.split()))
        if unknown:
            raise IndexerSourceError(
                f"unknown write option {unknown[0]!r}; known: {', '.join(WRITE_OPTIONS.split())}"
            )
        routers = tuple(
            u.strip().rstrip("/") for u in opts.get("router", "").split(",") if u.strip()
        )
        if not routers:
            raise IndexerSourceError(
                'give the routers to write through: .option("router", "http://HOST:PORT[,...]")'
            )
        for url in routers:
            if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
                raise IndexerSourceError(f"router: {url!r} is not an http:// or https:// URL")
        if not opts.get("id"):
            raise IndexerSourceError('give the id column: .option("id", "COLUMN")')
        wait = opts.get("wait", "persisted")
        if wait not in WAITS:
            raise IndexerSourceError(f'wait: "persisted" or "visible", not {wait!r}')
        on_error = opts.get("on_error", "fail")
        if on_error not in ("fail", "skip"):
            raise IndexerSourceError(f'on_error: "fail" or "skip", not {on_error!r}')
        nulls = opts.get("nulls", "omit")
        if nulls not in ("omit", "keep"):
            raise IndexerSourceError(f'nulls: "omit" or "keep", not {nulls!r}')
        return cls(
            routers=routers,
            id_column=opts["id"],
            delete_column=opts.get("delete") or None,
            doc_column=opts.get("doc") or None,
            wait=wait,
            skip_errors=on_error == "skip",
            keep_nulls=nulls == "keep",
            batch_rows=whole_option(opts, "batch_rows", 1, 1_000_000) or DEFAULT_BATCH_ROWS,
            batch_bytes=whole_option(opts, "batch_bytes", 1 << 10, 1 << 30) or DEFAULT_BATCH_BYTES,
            timeout=seconds_option(opts, "timeout", DEFAULT_WRITE_TIMEOUT_S),
            report=opts.get("report") or None,
            access=parse_access(opts),
        )


# --------------------------------------------------------------------------------------------
# Which router owns which vbucket


@dataclass(frozen=True)
class Owners:
    """Where each vbucket's lines go: the addresses that own it (several: spread by task)."""

    num_vbuckets: int
    urls: tuple[str, ...]
    owners: tuple[tuple[int, ...], ...]  # per vbucket, indexes into `urls`

    def target(self, docid: str, task: int) -> str:
        choices = self.owners[zlib.crc32(docid.encode()) % self.num_vbuckets]
        return self.urls[choices[task % len(choices)]]


def _ranges(text: str | None, num_vbuckets: int) -> list[int]:
    """The vbuckets of a router's `/stats` description ("vbuckets 0-511,768"; None: all)."""
    if text is None:
        return list(range(num_vbuckets))
    out: list[int] = []
    for part in text.removeprefix("vbuckets ").split(","):
        first, _, last = part.partition("-")
        out.extend(range(int(first), int(last or first) + 1))
    return out


def _same_host(a: str, b: str) -> bool:
    return urllib.parse.urlsplit(a).hostname == urllib.parse.urlsplit(b).hostname


def find_owners(options: WriterOptions) -> Owners:
    """Ask every router (its `GET /stats`) which vbuckets it owns."""
    urls: list[str] = []
    owned: dict[int, list[int]] = {}
    num_vbuckets = None
    for router in options.routers:
        try:
            stats = call_json(
                "GET", router, "/stats", access=options.access, timeout=options.timeout
            )
        except ClientError as exc:
            raise IndexerSourceError(f"router: {exc}") from None
        count = int(stats["source"]["vbuckets"])
        if num_vbuckets not in (None, count):
            raise IndexerSourceError(
                f"router: {router} has {count} vbuckets, the others {num_vbuckets}: they are "
                "not routers of one source"
            )
        num_vbuckets = count
        places: list[tuple[str, list[int]]] = []
        for shard in stats.get("shards") or []:
            # A shard's own address when it is reached the way its parent is; else the parent.
            url = shard.get("url")
            target = url if url and _same_host(url, router) else router
            places.append((target, _ranges(shard["vbuckets"], count)))
        if not places:
            places.append((router, _ranges(stats.get("vbuckets"), count)))
        for url, vbuckets in places:
            if url not in urls:
                urls.append(url)
            for vb in vbuckets:
                owned.setdefault(vb, []).append(urls.index(url))
    assert num_vbuckets is not None
    orphans = [vb for vb in range(num_vbuckets) if vb not in owned]
    if orphans:
        raise IndexerSourceError(
            f"router: no router given owns {len(orphans)} vbuckets (the first: {orphans[0]}); "
            "give every peer router of the source"
        )
    owners = tuple(tuple(dict.fromkeys(owned[vb])) for vb in range(num_vbuckets))
    return Owners(num_vbuckets, tuple(urls), owners)


# --------------------------------------------------------------------------------------------
# The writer


@dataclass
class IndexerCommit(WriterCommitMessage):
    """What one task wrote."""

    documents: int = 0
    deletes: int = 0
    skipped: int = 0
    requests: int = 0
    skipped_sample: list[str] = field(default_factory=list)

    def add(self, other: IndexerCommit) -> None:
        """Count what another part of the task wrote too."""
        self.documents += other.documents
        self.deletes += other.deletes
        self.skipped += other.skipped
        self.requests += other.requests
        room = SKIPPED_SAMPLE - len(self.skipped_sample)
        self.skipped_sample.extend(other.skipped_sample[: max(room, 0)])


class _PostInFlight:
    """At most one bulk on its way while the task builds the next, so that Spark's side (the
    rows read, their lines) and the router's (the lines parsed and appended) overlap instead
    of taking turns. One at a time keeps the task's rows in order; each post's tally is added
    to the task's commit on this thread, when the next waits for it."""

    def __init__(self, commit: IndexerCommit) -> None:
        self.commit = commit
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="indexer-writer-post")
        self._future: Future[IndexerCommit] | None = None

    def submit(self, post: Callable[[IndexerCommit], None]) -> None:
        """Start `post` (with a tally of its own) once the one before it is done."""
        self.wait()

        def run() -> IndexerCommit:
            tally = IndexerCommit()
            post(tally)
            return tally

        self._future = self._pool.submit(run)

    def wait(self) -> None:
        """Until the bulk on its way is written (its error raised here)."""
        future, self._future = self._future, None
        if future is not None:
            self.commit.add(future.result())

    def __enter__(self) -> _PostInFlight:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                self.wait()
            elif self._future is not None:
                self._future.cancel()
                wait_for([self._future])
        finally:
            self._pool.shutdown(wait=True)


@dataclass
class _Pending:
    lines: list[bytes] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # each line's row number in the task
    size: int = 0


class IndexerWriter(DataSourceArrowWriter):
    """Posts each task's rows to the routers in bounded bulks (see the module doc)."""

    def __init__(self, options: WriterOptions, owners: Owners, shape: RowShape) -> None:
        self.options = options
        self.owners = owners
        self.shape = shape

    def write(self, iterator: Iterator[Any]) -> IndexerCommit:
        from pyspark import TaskContext

        context = TaskContext.get()
        task = context.partitionId() if context is not None else 0
        commit = IndexerCommit()
        with _PostInFlight(commit) as posts:
            self._write_rows(iterator, task, commit, posts)
        if commit.skipped:
            log.warning(
                "indexer writer: task %d skipped %d bad rows (on_error=skip); the first: %s",
                task, commit.skipped, "; ".join(commit.skipped_sample),
            )  # fmt: skip
        return commit

    def _write_rows(
        self,
        iterator: Iterator[Any],
        task: int,
        commit: IndexerCommit,
        posts: _PostInFlight,
    ) -> None:
        """Lines of the task's rows, grouped by the router that owns each, posted in bulks."""
        pending: dict[str, _Pending] = {}
        number = 0  # of the row in the task
        for batch in iterator:
            built = batch_lines(self.shape, batch)  # column-wise, when it covers the batch
            rows = lines_of(self.shape, rows_of(batch)) if built is None else map(RowLine, *built)
            for row in rows:
                number += 1
                if row.line is None:
                    self._bad(commit, f"partition {task}, row {number}: {row.error}")
                    continue
                url = self.owners.target(row.docid, task)
                part = pending.get(url)
                if part is None:
                    part = pending[url] = _Pending()
                part.lines.append(row.line)
                part.ids.append(row.docid)
                part.rows.append(number)
                part.size += len(row.line)
                if (
                    len(part.lines) >= self.options.batch_rows
                    or part.size >= self.options.batch_bytes
                ):
                    posts.submit(functools.partial(self._post, url, pending.pop(url), task=task))
        for url, part in pending.items():
            posts.submit(functools.partial(self._post, url, part, task=task))

    def _bad(self, commit: IndexerCommit, error: str) -> None:
        if not self.options.skip_errors:
            raise IndexerSourceError(f"{error} (on_error=skip leaves such rows out)")
        commit.skipped += 1
        if len(commit.skipped_sample) < SKIPPED_SAMPLE:
            commit.skipped_sample.append(error)

    def _post(self, url: str, part: _Pending, commit: IndexerCommit, *, task: int) -> None:
        """Post the lines, and again those the router could not take for now, until timeout.
        A refused line is named by its row in the task and its id, never by its line in the
        request (which the user never sees)."""
        params = {
            "wait": self.options.wait,
            "timeout": f"{self.options.timeout:g}",
            "items": "errors",  # the good lines are counted, not listed
        }
        deadline = time.monotonic() + self.options.timeout
        backoff = RETRY_MIN_S
        lines, ids, rows = part.lines, part.ids, part.rows
        while lines:
            again: list[int] = []
            try:
                with request(
                    "POST", url, "/docs/_bulk", params=params, content=b"".join(lines),
                    content_type=NDJSON, timeout=self.options.timeout + 30,
                    access=self.options.access,
                ) as response:  # fmt: skip
                    answer = json.loads(response.read())
            except ClientError as exc:
                if exc.status is not None and exc.status not in RETRY_STATUSES:
                    raise IndexerSourceError(f"writing to {url}: {exc}") from None
                if time.monotonic() + backoff > deadline:
                    raise IndexerSourceError(
                        f"writing to {url}: {exc}; gave up after {self.options.timeout:g} s"
                    ) from None
                again = list(range(len(lines)))
            else:
                commit.requests += 1
                refused: set[int] = set()
                first_retry = ""
                for item in answer["items"]:
                    i = item["line"] - 1
                    refused.add(i)
                    reason = _REQUEST_LINE.sub("", item["error"])
                    if item.get("retry"):
                        again.append(i)
                        first_retry = first_retry or reason
                    else:
                        self._bad(
                            commit,
                            f"partition {task}, row {rows[i]}: row with id {ids[i]!r}: {reason}",
                        )
                commit.documents += answer["appended"]
                commit.deletes += sum(
                    1
                    for i, line in enumerate(lines)
                    if i not in refused and line.endswith(b'"deleted":true}\n')
                )
                if again and time.monotonic() + backoff > deadline:
                    raise IndexerSourceError(
                        f"writing to {url}: {len(again)} rows not taken within "
                        f"{self.options.timeout:g} s: {first_retry}"
                    )
            if again:
                time.sleep(backoff)
                backoff = min(backoff * 2, RETRY_MAX_S)
            lines = [lines[i] for i in again]
            ids = [ids[i] for i in again]
            rows = [rows[i] for i in again]

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        done = [m for m in messages if isinstance(m, IndexerCommit)]
        skipped = sum(m.skipped for m in done)
        log.info(
            "indexer writer: %d documents (%d deletes) in %d bulk requests, %d rows skipped",
            sum(m.documents for m in done), sum(m.deletes for m in done),
            sum(m.requests for m in done), skipped,
        )  # fmt: skip
        sample = [s for m in done for s in m.skipped_sample][:SKIPPED_SAMPLE]
        if skipped:
            log.warning(
                "indexer writer: skipped %d bad rows; the first: %s", skipped, "; ".join(sample)
            )
        if self.options.report is not None:
            figures = {
                "documents": sum(m.documents for m in done),
                "deletes": sum(m.deletes for m in done),
                "requests": sum(m.requests for m in done),
                "skipped": skipped,
                "skipped_sample": sample,
            }
            write_report(Path(self.options.report), figures)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        written = sum(m.documents for m in messages if isinstance(m, IndexerCommit))
        log.warning(
            "indexer writer: the job failed after the finished tasks wrote %d documents; running "
            "it again sends them again, which is harmless (the latest version wins)",
            written,
        )


class IndexerStreamWriter(DataSourceStreamArrowWriter):
    """`df.writeStream.format("indexer")`: each micro-batch is written as the batch writer
    writes a DataFrame. A batch Spark runs again after a failure (its commit was not recorded)
    sends the same rows again: each becomes the latest version of its document again, or
    deletes it again, so the indexes end the same (nothing changes twice)."""

    def __init__(self, options: WriterOptions, owners: Owners, shape: RowShape) -> None:
        self.batches = IndexerWriter(options, owners, shape)

    def write(self, iterator: Iterator[Any]) -> IndexerCommit:
        return self.batches.write(iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        log.info("indexer stream writer: micro-batch %d", batchId)
        self.batches.commit(messages)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        log.warning("indexer stream writer: micro-batch %d failed", batchId)
        self.batches.abort(messages)


def write_report(path: Path, figures: dict[str, Any]) -> None:
    """The job's figures as JSON, whole or not at all (written aside, then renamed)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        aside = path.with_name(f".{path.name}.tmp")
        aside.write_text(json.dumps(figures, indent=2) + "\n")
        aside.replace(path)
    except OSError as exc:
        raise IndexerSourceError(f"report: cannot write {path}: {exc.strerror or exc}") from None

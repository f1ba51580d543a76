"""A router shard's input: the lines its parent hands it over stdin (`indexer router --shards`).

The shard says HELLO with its HTTP address and how far its source log holds the parent's input,
then appends each LINES message as one synced batch together with the message's end position,
and acknowledges it on stdout. Lines its log already holds (a resend after a crash of either
process) are skipped by their offset. The parent's end of the pipe closing means the parent is
gone: the input ends, and the caller stops the shard.
"""

from __future__ import annotations

import logging
import os

import trio

from indexer.router.inputs.lines import parse_lines
from indexer.router.pipe import MessageReader, PipeError
from indexer.router.shards.messages import (
    ACK,
    LINES,
    InputPosition,
    LineBatch,
    decode_lines,
    encode_hello,
    encode_json,
)
from indexer.router.source.appender import Appender

log = logging.getLogger("indexer.router")

RECEIVE_BYTES = 1 << 20


def input_name(key: str) -> str:
    """The input's name in messages: its key up to the first "|" (a file's path)."""
    return key.split("|", 1)[0]


async def append_lines(appender: Appender, batch: LineBatch) -> tuple[int, int]:
    """Append the batch's lines, with the batch's end position in the same write, unless the
    log holds its piece already; (documents appended, bad lines)."""
    held = InputPosition.decode(appender.source.input_position)
    if held is not None and held.holds(batch):
        return 0, 0
    if held is not None and held.overlaps(batch):  # the parent cuts pieces where shards stand
        log.error(
            "%s: bytes %d-%d of the input are partly in the log already (to %d): appended "
            "again (the latest version wins)",
            input_name(batch.key), batch.start, batch.end, held.offset,
        )  # fmt: skip
    documents, errors = parse_lines(batch.numbered(), input_name(batch.key))
    for error in errors:
        log.error("skipped a bad input line: %s", error)
    for document in documents:
        if not appender.owns(document.docid):  # the parent routes by the same id: a bug
            log.error("document %r is not this shard's: left out", document.docid)
    await appender.append(documents, batch.position.encode())
    return len(documents), len(errors)


async def follow_parent(
    appender: Appender,
    http_url: str,
    receive: trio.abc.ReceiveStream,
    send: trio.abc.SendStream,
) -> None:
    """Say HELLO, then append what the parent sends until it closes the pipe."""
    position = InputPosition.decode(appender.source.input_position)
    await send.send_all(encode_hello(http_url, position, os.getpid()))
    reader = MessageReader()
    while True:
        data = await receive.receive_some(RECEIVE_BYTES)
        if not data:
            return
        reader.feed(data)
        while (message := reader.next()) is not None:
            kind, body = message
            if kind == LINES:
                appended, bad = await append_lines(appender, decode_lines(body))
                await send.send_all(encode_json(ACK, {"appended": appended, "bad": bad}))
            else:
                raise PipeError(f"message kind {kind} from the parent router")


async def follow_parent_stdio(appender: Appender, http_url: str) -> None:
    """`follow_parent` over this process's stdin and stdout (the pipes of the parent)."""
    receive = trio.lowlevel.FdStream(os.dup(0))
    send = trio.lowlevel.FdStream(os.dup(1))
    async with receive, send:
        await follow_parent(appender, http_url, receive, send)

"""The build encoder (indexer/router/streams/build_encoder.py): its pipe codec without a
process, and a real encoder process giving the frames the router itself would give."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from indexer import protocol as p
from indexer.router.documents import Document
from indexer.router.source.log import SourceLog
from indexer.router.streams.build_encoder import (
    CHUNKS,
    EncoderError,
    MessageReader,
    build_encoder,
    decode_chunks,
    decode_pieces,
    encode_chunks,
    encode_message,
    encode_pieces,
)
from indexer.router.streams.chunks import (
    RawChunk,
    latest_versions,
    read_backfill_chunk,
    read_raw_chunk,
    snapshot_frames,
)
from indexer.router.streams.records import RecordEncoder

INDEX = p.IndexDefinition("by_age", ("age",))
PARTIAL = p.IndexDefinition("adults", ("name",), "age >= 18")


def documents(count: int, ids: int) -> list[Document]:
    out = []
    for i in range(count):
        if i % 7 == 3:
            out.append(Document(f"d{i % ids}", None))
        else:
            body = {"age": i % 40, "name": f"n{i}", "pad": "é" * (i % 5)}
            out.append(Document(f"d{i % ids}", body))
    return out


def test_messages_split_anywhere_come_out_whole_and_in_order() -> None:
    chunks = [
        RawChunk(3, 1, 4, [(1, b'{"id":"a"}'), (4, b"")], False, 2),
        RawChunk(7, 10, 9, [], True, 0),
    ]
    stream = encode_chunks(chunks) + encode_message(9, b"x")
    for cut in range(len(stream) + 1):
        reader = MessageReader()
        got = []
        for part in (stream[:cut], stream[cut:]):
            reader.feed(part)
            while (message := reader.next()) is not None:
                got.append(message)
        assert [kind for kind, _ in got] == [CHUNKS, 9]
    assert decode_chunks(got[0][1]) == [(3, 1, 4, [(1, b'{"id":"a"}'), (4, b"")]), (7, 10, 9, [])]
    pieces = [([b"ab", b"c"], 2), ([b""], 0)]
    _, body = one_message(encode_pieces([(pieces, 5), ([], 0)]))
    assert decode_pieces(body) == [([([b"abc"], 2), ([b""], 0)], 5), ([], 0)]


def one_message(data: bytes) -> tuple[int, bytes]:
    reader = MessageReader()
    reader.feed(data)
    message = reader.next()
    assert message is not None and reader.next() is None
    return message


def test_malformed_pipe_messages_are_refused() -> None:
    reader = MessageReader()
    reader.feed(b"\x00\x00\x00\x00\x02")
    with pytest.raises(EncoderError):
        reader.next()
    body = encode_chunks([RawChunk(1, 1, 1, [(1, b"abc")], True, 1)])[5:]
    with pytest.raises(EncoderError):
        decode_chunks(body + b"extra")


def test_the_encoder_process_gives_the_routers_own_frames_latest_versions_only(
    tmp_path: Path,
) -> None:
    source = SourceLog(tmp_path / "log", num_vbuckets=4)
    source.append(documents(900, ids=300))
    indexes = [INDEX, PARTIAL]
    records = RecordEncoder(indexes)
    raw = [read_raw_chunk(source, vb, 0, source.high_seqno(vb), 10_000) for vb in range(4)]
    # A piece limit that cuts: several MUTATIONS frames per chunk.
    batch_bytes, batch_records = 4096, 16

    async def main() -> None:
        async with build_encoder(indexes, batch_bytes, batch_records) as encoder:
            encoded = await encoder.encode(raw)
            assert await encoder.encode([]) == []
            # Its own answers, one exchange after another, stay in order.
            again = await encoder.encode(raw[::-1])
        assert [e.vbucket for e in again] == [3, 2, 1, 0]
        for chunk, got in zip(raw, encoded, strict=True):
            parsed = read_backfill_chunk(source, chunk.vbucket, 0, chunk.end, 10_000)
            kept = latest_versions(list(source.read(chunk.vbucket, 0)))  # the router's own
            want = list(
                snapshot_frames(
                    records, batch_bytes, batch_records, chunk.vbucket, 1, chunk.end, kept
                )
            )
            assert [b"".join(f) for f, _ in got.pieces] == [b"".join(f) for f, _ in want]
            assert [n for _, n in got.pieces] == [n for _, n in want]
            assert got.kept == len(kept) == len(parsed.versions) < chunk.read
            assert (got.start, got.end, got.last, got.read) == (1, chunk.end, True, chunk.read)
            assert len(got.pieces) > 2

    trio.run(main)
    source.close()


def test_a_document_whose_key_outgrows_a_frame_is_left_out_of_the_index_and_logged(
    capfd: pytest.CaptureFixture[str],
) -> None:
    huge = '{"id":"big","doc":{"age":"' + "x" * 10_000 + '"}}'
    small = '{"id":"small","doc":{"age":3}}'
    chunk = RawChunk(0, 1, 2, [(1, huge.encode()), (2, small.encode())], True, 2)

    async def main() -> list[p.Mutation]:
        async with build_encoder([INDEX], 1024, 16, max_frame_bytes=2048) as encoder:
            (encoded,) = await encoder.encode([chunk])
        decoder = p.FrameDecoder(2048)  # every frame fits the node's limit
        for frames, _ in encoded.pieces:
            for frame in frames:
                decoder.feed(frame)
        batches = [m for m in decoder.messages() if type(m) is p.MutationBatch]
        return [mutation for batch in batches for mutation in batch.mutations()]

    mutations = trio.run(main)
    assert [(m.seqno, m.docid) for m in mutations] == [(1, b"big"), (2, b"small")]
    assert mutations[0].keys == (b"",) and not mutations[0].deleted  # out of the index
    assert mutations[1].keys != (b"",)
    err = capfd.readouterr().err
    assert "'big' (seqno 1) left out of index by_age" in err
    assert "server.max_frame_bytes = 2,048" in err

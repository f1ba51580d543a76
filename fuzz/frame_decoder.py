"""Coverage-guided fuzz target (atheris, libFuzzer) for the wire protocol's FrameDecoder.

Any bytes, fed in chunks, must give messages or a ProtocolError, and the same outcome as when
fed at once; anything else is a bug and stops the fuzzer with the input saved as a crash file.

    python fuzz/frame_decoder.py -max_total_time=60 [CORPUS_DIR ...]
    python fuzz/frame_decoder.py --write-seeds CORPUS_DIR   # valid frames to start from
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project, installed or not
with atheris.instrument_imports():
    from indexer import protocol as p

SMALL_MAX = 256  # a frame limit the fuzzed length fields reach


Outcome = tuple[list[p.Message], p.ErrorCode | None, p.ErrorCode | None]


def decode(chunks: list[bytes], max_frame: int) -> Outcome:
    """Messages, then the first error code and the error code at close (None if none)."""
    decoder = p.FrameDecoder(max_frame)
    # Handshakes may be larger than other frames (p.MAX_HANDSHAKE_BYTES).
    held = max(max_frame, p.MAX_HANDSHAKE_BYTES)
    out: list[p.Message] = []
    for chunk in chunks:
        decoder.feed(chunk)
        try:
            while batch := decoder.messages():
                out.extend(batch)
        except p.ProtocolError as exc:
            return out, exc.code, None
        if decoder.buffered > held + 3:
            raise AssertionError(f"{decoder.buffered} bytes held back, limit {held}")
    try:
        decoder.close()
    except p.ProtocolError as exc:
        return out, None, exc.code
    return out, None, None


def test_one_input(data: bytes) -> None:
    """The first byte picks the chunk size and the frame limit; the rest is the stream."""
    if not data:
        return
    control, stream = data[0], data[1:]
    size = (control & 0x7F) + 1
    max_frame = SMALL_MAX if control & 0x80 else p.DEFAULT_MAX_FRAME_BYTES
    whole = decode([stream], max_frame)
    pieces = decode([stream[i : i + size] for i in range(0, len(stream), size)], max_frame)
    if pieces != whole:
        raise AssertionError(f"chunks of {size} bytes: {pieces!r}, at once: {whole!r}")


def seed_inputs() -> list[bytes]:
    """Valid frames of every type (with a control byte), so the fuzzer starts deep."""
    record = p.encode_record(p.Mutation(7, b"doc", (b"\x06a\x00\x00", b"")))
    delete = p.encode_record(p.Mutation(8, b"doc", (b"", b""), deleted=True))
    position = p.VbucketPosition(3, 10, 99)
    messages: list[p.Message] = [
        p.Handshake("r", 1024, (1, 2), {1: ((5, 10), (4, 0))}, True, "idx"),
        p.HandshakeReply(
            (p.IndexDefinition("i", ("a", "b.c"), "a >= 1"),), 1024, (1,), (position,), 4096
        ),
        p.StreamBegin(3, 2**40),
        p.StreamEnd(3, 1),
        p.SnapshotMarker(3, 1, 9),
        p.Ack((position,)),
        p.Error(p.ErrorCode.SEQNO_BACKWARDS, "seqno"),
        p.Barrier(5),
        p.BarrierReply(5, True, (position,)),
        p.BufferAck(4096),
    ]
    frames = [p.encode(m) for m in messages]
    frames.append(p.encode_mutations(3, 2, [record, delete]))
    frames.append(struct.pack(">IBB", 2**31, p.VERSION, p.MessageType.MUTATIONS))
    seeds = [bytes([control]) + f for f in frames for control in (0x7F, 0x80)]
    seeds.append(b"\x03" + b"".join(frames))
    return seeds


def main() -> None:
    """Write the seed corpus, or fuzz with the libFuzzer arguments given."""
    if len(sys.argv) == 3 and sys.argv[1] == "--write-seeds":
        corpus = Path(sys.argv[2])
        corpus.mkdir(parents=True, exist_ok=True)
        for i, seed in enumerate(seed_inputs()):
            (corpus / f"seed-{i:02d}").write_bytes(seed)
        return
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()

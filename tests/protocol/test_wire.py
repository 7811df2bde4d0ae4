import zlib

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memkv.protocol.wire import (
    MAGIC,
    FrameReader,
    WireError,
    block_frame_prefix,
    block_payload,
    encode_frame,
    end_frame,
)


def body(n_blocks=3, seed=0):
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal((2, 2, 2, 4, 8)).astype(np.float16) for _ in range(n_blocks)]
    chunks: list[bytes] = b"".join(encode_frame({"kind": "turn", "turn": 1}))
    out = bytearray(chunks)
    for i, a in enumerate(arrays):
        data = memoryview(a).cast("B")
        out += block_frame_prefix(
            index=i, key=bytes([i]) * 16, dtype="float16", shape=a.shape, data=data
        )
        out += data
    out += end_frame(n_blocks)
    return bytes(out), arrays


def parse(data: bytes, cuts: list[int]) -> list:
    reader = FrameReader(max_payload_bytes=1 << 20)
    frames = []
    prev = 0
    for cut in sorted(set(c for c in cuts if 0 < c < len(data))) + [len(data)]:
        frames.extend(reader.feed(data[prev:cut]))
        prev = cut
    reader.close()
    return frames


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=30))
def test_any_chunking_gives_the_same_frames(cuts):
    data, arrays = body()
    frames = parse(data, cuts)
    assert [f.kind for f in frames] == ["turn", "block", "block", "block", "end"]
    for frame, array in zip(frames[1:4], arrays, strict=True):
        key, dtype, got = block_payload(frame)
        assert dtype == "float16" and np.array_equal(got, array)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_truncation_anywhere_is_detected(data):
    full, _ = body(2)
    cut = data.draw(st.integers(min_value=1, max_value=len(full) - 1))
    reader = FrameReader(max_payload_bytes=1 << 20)
    frames = list(reader.feed(full[:cut]))
    if frames and frames[-1].kind == "end":
        return  # cut exactly after the end frame's... cannot happen before len(full)
    try:
        reader.close()
    except WireError:
        return
    # A cut on a frame boundary parses cleanly but lacks the end frame: the
    # protocol layer (count of blocks, the end frame) catches that.
    assert not frames or frames[-1].kind != "end"


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_flipped_payload_byte_fails_the_checksum(data):
    full, _ = body(1)
    frames = parse(full, [])
    block = frames[1]
    pos = data.draw(st.integers(min_value=0, max_value=len(block.payload) - 1))
    block.payload[pos] ^= 0x01
    with pytest.raises(WireError, match="checksum"):
        block_payload(block)


def test_header_payload_disagreements():
    full, _ = body(1)
    block = parse(full, [])[1]
    bad_shape = type(block)({**block.header, "shape": [2, 2, 2, 4, 9]}, block.payload)
    with pytest.raises(WireError, match="payload has"):
        block_payload(bad_shape)
    bad_dtype = type(block)({**block.header, "dtype": "int4"}, block.payload)
    with pytest.raises(WireError, match="dtype"):
        block_payload(bad_dtype)
    bad_key = type(block)({**block.header, "key": b"short"}, block.payload)
    with pytest.raises(WireError, match="key"):
        block_payload(bad_key)
    with pytest.raises(WireError, match="block frame"):
        block_payload(parse(full, [])[0])


def test_malformed_prefixes_and_headers():
    with pytest.raises(WireError, match="magic"):
        list(FrameReader(1024).feed(b"XXXX\x00\x00\x00\x00"))
    with pytest.raises(WireError, match="exceeds"):
        list(FrameReader(1024).feed(MAGIC + (2**31).to_bytes(4, "little")))
    not_msgpack = b"\xc1"  # a reserved byte
    with pytest.raises(WireError, match="msgpack"):
        list(FrameReader(1024).feed(MAGIC + len(not_msgpack).to_bytes(4, "little") + not_msgpack))
    too_big = msgpack.packb({"kind": "block", "nbytes": 4096})
    with pytest.raises(WireError, match="exceeds 1024"):
        list(FrameReader(1024).feed(MAGIC + len(too_big).to_bytes(4, "little") + too_big))
    arr = msgpack.packb([1, 2])
    with pytest.raises(WireError, match="map"):
        list(FrameReader(1024).feed(MAGIC + len(arr).to_bytes(4, "little") + arr))
    assert zlib.crc32(b"") == 0


def test_a_body_of_header_only_frames_is_refused_as_it_arrives():
    """[2/6] item 7: 40 MB of header-only frames took +800 MiB and 9 s of CPU before the
    answer; now the reader stops at the bound, whatever the body still declares."""
    import pytest

    from memkv.protocol.wire import (
        MAX_BLOCK_HEADER_BYTES,
        MAX_BODY_BLOCKS,
        FrameReader,
        WireError,
        encode_frame,
    )

    reader = FrameReader(max_payload_bytes=1 << 30)
    turn = b"".join(bytes(c) for c in encode_frame({"kind": "turn", "tokens": b"\0" * 64}))
    block = b"".join(bytes(c) for c in encode_frame({"kind": "block"}))
    assert len(list(reader.feed(turn))) == 1
    with pytest.raises(WireError, match="block frames"):
        for _ in range(MAX_BODY_BLOCKS + 1):
            list(reader.feed(block))
    # One block frame's header may not be huge either (the turn frame's may).
    big = FrameReader(max_payload_bytes=1 << 30)
    list(big.feed(turn))
    huge = b"MKVF" + (MAX_BLOCK_HEADER_BYTES + 1).to_bytes(4, "little")
    with pytest.raises(WireError, match="a block frame's is at most"):
        list(big.feed(huge))

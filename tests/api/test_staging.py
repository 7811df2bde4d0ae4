"""The gateway's append staging segment: leases, offsets, reuse, clean-up."""

import os

import numpy as np
import pytest

from memkv.protocol.wire import FrameReader, encode_frame
from memkv.shm.staging import STAGING_UNIT_BYTES, PutStaging


@pytest.fixture
def staging():
    s = PutStaging(16 * STAGING_UNIT_BYTES)
    yield s
    if os.path.exists(f"/dev/shm/{s.segment}"):
        s.close()


def test_slots_hand_out_views_of_the_segment_front_to_back(staging):
    slot = staging.lease(3 * STAGING_UNIT_BYTES)
    a, b = slot.take(100), slot.take(200)
    assert staging.offset_of(np.frombuffer(a, np.uint8)) == slot.offset
    assert staging.offset_of(np.frombuffer(b, np.uint8)) == slot.offset + 100
    a[:] = b"x" * 100
    assert bytes(staging.array[slot.offset : slot.offset + 100]) == b"x" * 100
    assert slot.take(3 * STAGING_UNIT_BYTES) is None  # past the slot's end
    with pytest.raises(ValueError, match="not a view"):
        staging.offset_of(np.zeros(4, np.uint8))


def test_a_full_segment_says_so_and_freed_space_is_reused(staging):
    slots = [staging.lease(4 * STAGING_UNIT_BYTES) for _ in range(4)]
    assert all(slots) and staging.lease(1) is None
    assert staging.lease(17 * STAGING_UNIT_BYTES) is None  # larger than the segment
    slots[1].release()
    slots[1].release()  # idempotent
    again = staging.lease(4 * STAGING_UNIT_BYTES)
    assert again is not None and again.offset == slots[1].offset
    assert slots[1].take(1) is None  # a released slot hands out nothing


def test_close_unlinks_the_segment_and_its_lock():
    s = PutStaging(STAGING_UNIT_BYTES)
    assert os.path.exists(f"/dev/shm/{s.segment}")
    s.close()
    assert not os.path.exists(f"/dev/shm/{s.segment}")
    assert not os.path.exists(f"/dev/shm/{s.segment}.lock")


def test_frame_payloads_land_where_the_reader_is_told(staging):
    slot = staging.lease(STAGING_UNIT_BYTES)
    body = b"".join(bytes(c) for c in encode_frame({"kind": "turn"}))
    payload = bytes(range(256)) * 4
    body += b"".join(bytes(c) for c in encode_frame({"kind": "block", "nbytes": len(payload)},
                                                    payload))
    reader = FrameReader(max_payload_bytes=len(body), allocate=slot.take)
    frames = [f for i in range(0, len(body), 97) for f in reader.feed(body[i : i + 97])]
    reader.close()
    assert [f.kind for f in frames] == ["turn", "block"]
    assert bytes(frames[1].payload) == payload
    assert staging.offset_of(np.frombuffer(frames[1].payload, np.uint8)) == slot.offset
    # Without room in the slot the reader falls back to a buffer of its own (committed as
    # bytes arrive: memkv.protocol.wire.payload_buffer).
    full = FrameReader(max_payload_bytes=len(body), allocate=lambda n: None)
    (_, block) = list(full.feed(body))
    with pytest.raises(ValueError, match="not a view of the staging segment"):
        staging.offset_of(np.frombuffer(block.payload, np.uint8))
    assert bytes(block.payload) == payload


def test_a_dead_writers_segment_is_reclaimed_by_the_next_one():
    s = PutStaging(STAGING_UNIT_BYTES)
    # As if its process died: the lock file stays but nobody holds it; the segment is left.
    os.close(s._ownership._fd)
    s._ownership._fd = -1
    assert os.path.exists(f"/dev/shm/{s.segment}")
    fresh = PutStaging(STAGING_UNIT_BYTES)
    try:
        assert not os.path.exists(f"/dev/shm/{s.segment}")
    finally:
        fresh.close()

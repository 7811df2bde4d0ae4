"""Hypothesis fuzzing of what reads untrusted or damaged bytes: the wire decoder and the archive.

Whatever the bytes, the wire decoder raises WireError (an InvalidInputError:
422) and nothing else, and never allocates more than the body declared; the
archive reopens over damaged segment files, serves every record that is
intact and never serves a damaged one.
"""

import random

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memkv.errors import CorruptDataError, UnknownBlockError
from memkv.protocol.wire import MAGIC, FrameReader, WireError, encode_frame
from memkv.storage.config import ArchiveConfig
from memkv.storage.segments import SegmentStore

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _feed_all(data: bytes, chunk: int, limit: int) -> None:
    reader = FrameReader(max_payload_bytes=limit)
    for i in range(0, len(data), chunk):
        list(reader.feed(data[i : i + chunk]))
    reader.close()


@FUZZ
@given(data=st.binary(max_size=4096), chunk=st.integers(1, 512))
def test_random_bytes_only_ever_raise_wire_errors(data, chunk):
    try:
        _feed_all(data, chunk, limit=len(data))
    except WireError:
        pass


def _frames(draw_header):
    return b"".join(bytes(c) for c in encode_frame(draw_header))


headers = st.dictionaries(
    st.text(max_size=8),
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.binary(max_size=32)
        | st.text(max_size=16),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner),
        max_leaves=20,
    ),
    max_size=6,
)


@FUZZ
@given(header=headers, cut=st.integers(0, 64), flip=st.integers(0, 4096))
def test_mutated_frames_only_ever_raise_wire_errors(header, cut, flip):
    data = bytearray(_frames(header) + _frames({"kind": "end", "count": 0}))
    data[flip % len(data)] ^= 0xA5
    try:
        _feed_all(bytes(data[: max(0, len(data) - cut)]), 7, limit=len(data))
    except WireError:
        pass


def test_deep_or_huge_headers_are_refused_before_anything_is_allocated():
    deep = b"\x91" * 100_000 + b"\xc0"  # 100k nested arrays
    frame = MAGIC + len(deep).to_bytes(4, "little") + deep
    with pytest.raises(WireError, match="msgpack"):
        _feed_all(frame, 4096, limit=1 << 20)
    lying = msgpack.packb({"kind": "block", "nbytes": 1 << 40})
    frame = MAGIC + len(lying).to_bytes(4, "little") + lying
    with pytest.raises(WireError, match="exceeds"):
        _feed_all(frame, 4096, limit=1 << 20)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), damage=st.integers(1, 12))
def test_the_archive_reopens_over_damage_and_never_serves_a_damaged_record(
    tmp_path_factory, seed, damage
):
    rng = random.Random(seed)
    directory = tmp_path_factory.mktemp("seg")
    config = ArchiveConfig(directory=directory, fsync="never", segment_max_bytes=8192)
    records = {}
    with SegmentStore(config) as store:
        for _ in range(24):
            key = rng.randbytes(16)
            payload = rng.randbytes(rng.randint(1, 900))
            store.put(key, payload, fingerprint=b"\x01" * 16, codec_id=0)
            records[key] = payload
    files = sorted(directory.glob("seg-*.log"))
    for _ in range(damage):  # flip bytes anywhere, truncate a file now and then
        path = rng.choice(files)
        data = bytearray(path.read_bytes())
        if not data:
            continue
        if rng.random() < 0.2:
            path.write_bytes(bytes(data[: rng.randrange(len(data))]))
            continue
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
    with SegmentStore(config, verify_on_open=False) as store:
        for key, payload in records.items():
            try:
                got = store.get(key)
            except (CorruptDataError, UnknownBlockError):
                continue  # damaged or lost: refused, never served
            assert bytes(got) == payload

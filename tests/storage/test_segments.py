import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memkv.errors import (
    ClosedError,
    CorruptDataError,
    InvalidInputError,
    UnknownBlockError,
)
from memkv.protocol import layout
from memkv.storage.config import ArchiveConfig
from memkv.storage.owned_dir import LOCK_NAME
from memkv.storage.segments import (
    FINGERPRINT_BYTES,
    HEADER_BYTES,
    MAGIC,
    RecordMeta,
    SegmentStore,
    segment_name,
)

FP = bytes(range(16))
SEG_RE = re.compile(r"^seg-\d{8}\.log$")


def make_config(directory: Path, **kw: object) -> ArchiveConfig:
    kw.setdefault("fsync", "never")
    return ArchiveConfig(directory=directory, **kw)


@contextmanager
def temp_dir() -> Iterator[Path]:
    # Hypothesis runs many examples per test: a fresh directory each (tmp_path is per test).
    with tempfile.TemporaryDirectory() as d:
        yield Path(d) / "archive"


def seg_paths(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if SEG_RE.match(p.name))


def contents(store: SegmentStore) -> dict[bytes, bytes]:
    return {k: store.get(k) for k in store.keys()}


def record_size(key: bytes, payload: bytes) -> int:
    return HEADER_BYTES + len(key) + len(payload)


def check_accounting(store: SegmentStore, directory: Path) -> None:
    s = store.stats()
    assert s.live_bytes + s.tombstone_bytes + s.dead_bytes == s.bytes_on_disk
    assert s.bytes_on_disk == sum(p.stat().st_size for p in seg_paths(directory))
    assert s.segments == len(seg_paths(directory))
    assert s.live_records == len(store)


def flip(path: Path, offset: int, mask: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ mask]))


# ---------------------------------------------------------------- basics


def test_put_get_meta_len_contains(tmp_path: Path) -> None:
    with SegmentStore(make_config(tmp_path)) as store:
        meta = store.put(b"a", b"alpha", fingerprint=FP, codec_id=7)
        assert meta == RecordMeta(b"a", FP, 7, 5, meta.segment, 0)
        store.put(b"b", bytearray(b"beta"), fingerprint=FP, codec_id=0)
        store.put(b"c", memoryview(b""), fingerprint=FP, codec_id=65535)
        assert store.get(b"a") == b"alpha"
        assert store.get(b"b") == b"beta"
        assert store.get(b"c") == b""
        assert store.meta(b"b").offset == record_size(b"a", b"alpha")
        assert len(store) == 3 and sorted(store.keys()) == [b"a", b"b", b"c"]
        assert b"a" in store and b"zz" not in store and "a" not in store
        with pytest.raises(UnknownBlockError):
            store.get(b"zz")
        with pytest.raises(UnknownBlockError):
            store.meta(b"zz")
        check_accounting(store, tmp_path)


def test_memoryview_payloads_are_written_as_bytes(tmp_path: Path) -> None:
    arr = np.arange(24, dtype=np.float16).reshape(2, 3, 4)
    with SegmentStore(make_config(tmp_path)) as store:
        store.put(b"np", memoryview(arr), fingerprint=FP, codec_id=1)
        assert store.get(b"np") == arr.tobytes()
        with pytest.raises(InvalidInputError, match="contiguous"):
            store.put(b"nc", memoryview(arr[:, :, ::2]), fingerprint=FP, codec_id=1)


def test_fingerprint_size_matches_layout() -> None:
    assert FINGERPRINT_BYTES == layout.FINGERPRINT_BYTES


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"key": "str"}, "key must be bytes"),
        ({"key": bytearray(b"k")}, "key must be bytes"),
        ({"key": b""}, "1..64 bytes"),
        ({"key": b"x" * 65}, "1..64 bytes"),
        ({"payload": "text"}, "payload must be"),
        ({"payload": [1, 2]}, "payload must be"),
        ({"fingerprint": b"short"}, "16 bytes, got 5 bytes"),
        ({"fingerprint": "f" * 16}, "16 bytes, got str"),
        ({"codec_id": -1}, "0..65535"),
        ({"codec_id": 65536}, "0..65535"),
        ({"codec_id": True}, "must be an int"),
        ({"codec_id": 1.0}, "must be an int"),
    ],
)
def test_bad_input_is_rejected_and_changes_nothing(
    tmp_path: Path, kwargs: dict[str, object], match: str
) -> None:
    args: dict[str, object] = {"key": b"k", "payload": b"v", "fingerprint": FP, "codec_id": 1}
    args.update(kwargs)
    with SegmentStore(make_config(tmp_path)) as store:
        with pytest.raises(InvalidInputError, match=match) as info:
            store.put(
                args["key"],  # type: ignore[arg-type]
                args["payload"],  # type: ignore[arg-type]
                fingerprint=args["fingerprint"],  # type: ignore[arg-type]
                codec_id=args["codec_id"],  # type: ignore[arg-type]
            )
        assert isinstance(info.value, ValueError)
        assert len(store) == 0 and store.stats().bytes_on_disk == 0


def test_bad_keys_on_read_paths(tmp_path: Path) -> None:
    with SegmentStore(make_config(tmp_path)) as store:
        for call in (store.get, store.meta, store.delete):
            with pytest.raises(InvalidInputError):
                call("k")  # type: ignore[arg-type]
            with pytest.raises(InvalidInputError):
                call(b"x" * 65)
    with pytest.raises(InvalidInputError, match="ArchiveConfig"):
        SegmentStore({"directory": str(tmp_path)})  # type: ignore[arg-type]


def test_closed_store_raises(tmp_path: Path) -> None:
    store = SegmentStore(make_config(tmp_path))
    store.put(b"k", b"v", fingerprint=FP, codec_id=1)
    store.close()
    store.close()  # idempotent
    calls = [
        lambda: store.get(b"k"),
        lambda: store.put(b"k", b"v", fingerprint=FP, codec_id=1),
        lambda: store.delete(b"k"),
        lambda: store.meta(b"k"),
        lambda: b"k" in store,
        lambda: len(store),
        lambda: store.keys(),
        store.flush,
        store.stats,
        store.compact,
    ]
    for call in calls:
        with pytest.raises(ClosedError):
            call()


def test_file_names_never_come_from_keys(tmp_path: Path) -> None:
    with SegmentStore(make_config(tmp_path, segment_max_bytes=4096)) as store:
        for i in range(40):
            store.put(b"../../etc/passwd%d" % i, b"x" * 200, fingerprint=FP, codec_id=1)
    names = sorted(n for n in os.listdir(tmp_path) if n != LOCK_NAME)
    assert names and all(SEG_RE.match(n) for n in names)
    assert names[0] == segment_name(1) == "seg-00000001.log"


def test_delete_and_overwrite_semantics(tmp_path: Path) -> None:
    cfg = make_config(tmp_path)
    with SegmentStore(cfg) as store:
        store.put(b"a", b"1", fingerprint=FP, codec_id=1)
        store.put(b"a", b"2", fingerprint=FP, codec_id=2)
        store.put(b"b", b"3", fingerprint=FP, codec_id=1)
        assert store.delete(b"b") is True
        assert store.delete(b"b") is False
        assert store.delete(b"never") is False
        assert store.get(b"a") == b"2" and store.meta(b"a").codec_id == 2
        assert b"b" not in store
        store.put(b"b", b"4", fingerprint=FP, codec_id=1)  # re-created after delete
        store.delete(b"a")
        check_accounting(store, tmp_path)
    with SegmentStore(cfg) as store:
        assert contents(store) == {b"b": b"4"}
        check_accounting(store, tmp_path)


# Random operation sequences against a dict model, reopening and compacting on the way.
op_st = st.one_of(
    st.tuples(st.just("put"), st.integers(0, 7), st.binary(max_size=300)),
    st.tuples(st.just("delete"), st.integers(0, 7), st.just(b"")),
    st.tuples(st.just("reopen"), st.just(0), st.just(b"")),
    st.tuples(st.just("compact"), st.booleans(), st.just(b"")),
)


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(op_st, max_size=40))
def test_operations_match_a_dict_model_across_reopen_and_compaction(ops: list) -> None:
    with temp_dir() as d:
        cfg = make_config(d, segment_max_bytes=4096, compact_garbage_ratio=0.3)
        store = SegmentStore(cfg)
        model: dict[bytes, bytes] = {}
        try:
            for op, arg, data in ops:
                if op == "put":
                    key = b"key%d" % arg
                    store.put(key, data, fingerprint=FP, codec_id=arg)
                    model[key] = data
                elif op == "delete":
                    key = b"key%d" % arg
                    assert store.delete(key) == (key in model)
                    model.pop(key, None)
                elif op == "reopen":
                    store.close()
                    store = SegmentStore(cfg)
                else:
                    store.compact(force=arg)
                assert contents(store) == model
            check_accounting(store, d)
            store.close()
            store = SegmentStore(cfg)
            assert contents(store) == model
            assert store.stats().corrupt_records == 0
            check_accounting(store, d)
        finally:
            store.close()


def test_concurrent_threads(tmp_path: Path) -> None:
    with SegmentStore(make_config(tmp_path, segment_max_bytes=8192)) as store:
        errors: list[BaseException] = []

        def work(t: int) -> None:
            try:
                for i in range(50):
                    key = b"t%d-%d" % (t, i)
                    store.put(key, key * 10, fingerprint=FP, codec_id=t)
                    assert store.get(key) == key * 10
                    if i % 3 == 0:
                        store.delete(key)
                    if i % 20 == 0:
                        store.compact()
            except BaseException as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors
        assert len(store) == 4 * sum(1 for i in range(50) if i % 3)
        check_accounting(store, tmp_path)


# ---------------------------------------------------------------- torn writes


def write_records(cfg: ArchiveConfig, n: int) -> tuple[dict[bytes, bytes], list[int]]:
    """n records in one segment; returns the values and each record's end offset."""
    values: dict[bytes, bytes] = {}
    ends: list[int] = []
    with SegmentStore(cfg) as store:
        for i in range(n):
            key, payload = b"k%d" % i, bytes([i]) * (10 + 7 * i)
            meta = store.put(key, payload, fingerprint=FP, codec_id=i)
            values[key] = payload
            ends.append(meta.offset + record_size(key, payload))
    return values, ends


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_torn_tail_at_any_byte_is_cut_and_appends_continue(data: st.DataObject) -> None:
    with temp_dir() as d:
        cfg = make_config(d)
        values, ends = write_records(cfg, 6)
        path = d / segment_name(1)
        cut = data.draw(st.integers(0, ends[-1]), label="cut")
        with open(path, "r+b") as f:
            f.truncate(cut)
        keep = [k for k, end in zip(values, ends, strict=True) if end <= cut]
        good_end = max([e for e in ends if e <= cut], default=0)
        with SegmentStore(cfg) as store:
            assert contents(store) == {k: values[k] for k in keep}
            assert path.stat().st_size == good_end  # truncated to the last good record
            assert store.stats().corrupt_records == 0
            store.put(b"new", b"after the tear", fingerprint=FP, codec_id=3)
        with SegmentStore(cfg) as store:
            expected = {k: values[k] for k in keep} | {b"new": b"after the tear"}
            assert contents(store) == expected
            check_accounting(store, d)


@settings(max_examples=60, deadline=None)
@given(
    garbage=st.one_of(
        st.binary(min_size=1, max_size=200),
        st.binary(max_size=120).map(lambda b: MAGIC + b),
        st.integers(1, HEADER_BYTES + 40).map(lambda n: b"\0" * n),
    )
)
def test_garbage_appended_at_tail_is_cut(garbage: bytes) -> None:
    with temp_dir() as d:
        cfg = make_config(d)
        values, ends = write_records(cfg, 4)
        path = d / segment_name(1)
        with open(path, "ab") as f:
            f.write(garbage)
        with SegmentStore(cfg) as store:
            assert contents(store) == values
            assert path.stat().st_size == ends[-1]
            store.put(b"new", b"v", fingerprint=FP, codec_id=3)
        with SegmentStore(cfg) as store:
            assert contents(store) == values | {b"new": b"v"}


def test_tail_whose_data_never_landed_is_a_torn_write(tmp_path: Path) -> None:
    # After a power cut the file size may be extended while the last record's
    # payload reads back as zeros: its header verifies, its payload does not.
    cfg = make_config(tmp_path)
    with SegmentStore(cfg) as store:
        store.put(b"k", b"v1" * 50, fingerprint=FP, codec_id=1)
        meta = store.put(b"k", b"v2" * 50, fingerprint=FP, codec_id=1)
    path = tmp_path / segment_name(1)
    with open(path, "r+b") as f:
        f.seek(meta.offset + HEADER_BYTES + 1)
        f.write(b"\0" * 100)
    with SegmentStore(cfg) as store:
        assert store.get(b"k") == b"v1" * 50
        assert path.stat().st_size == meta.offset
        assert store.stats().corrupt_records == 0


def test_copy_of_a_record_prefix_at_tail_is_a_torn_write(tmp_path: Path) -> None:
    cfg = make_config(tmp_path)
    values, ends = write_records(cfg, 3)
    path = tmp_path / segment_name(1)
    raw = path.read_bytes()
    # Looks like a real record (magic, valid header) whose payload never made it to disk.
    path.write_bytes(raw + raw[ends[0] : ends[1] - 3])
    with SegmentStore(cfg) as store:
        assert contents(store) == values
        assert path.stat().st_size == ends[-1]


# ---------------------------------------------------------------- bit flips


def build_spread(d: Path) -> tuple[ArchiveConfig, list[tuple]]:
    """Records spread over several segments; returns (config, [(key, payload, meta)])."""
    cfg = make_config(d, segment_max_bytes=4096)
    recs = []
    with SegmentStore(cfg) as store:
        for i in range(20):
            key, payload = b"key-%02d" % i, bytes([i + 1]) * (300 + 13 * i)
            recs.append((key, payload, store.put(key, payload, fingerprint=FP, codec_id=i)))
    assert len(seg_paths(d)) >= 3
    return cfg, recs


@settings(max_examples=50, deadline=None)
@given(data=st.data(), verify=st.booleans())
def test_flipped_byte_is_never_served_and_others_survive(data: st.DataObject, verify: bool) -> None:
    with temp_dir() as d:
        cfg, recs = build_spread(d)
        i = data.draw(st.integers(0, len(recs) - 1), label="record")
        key, payload, meta = recs[i]
        at = data.draw(st.integers(0, record_size(key, payload) - 1), label="byte")
        mask = data.draw(st.integers(1, 255), label="mask")
        flip(d / segment_name(meta.segment), meta.offset + at, mask)
        with SegmentStore(cfg, verify_on_open=verify) as store:
            for k, p, _ in recs:
                if k != key:
                    assert store.get(k) == p
            # The damaged record is dropped on open, or refused on read.
            with pytest.raises((CorruptDataError, UnknownBlockError)):
                store.get(key)
            last = meta.segment == int(seg_paths(d)[-1].name[4:12])
            in_header = at < HEADER_BYTES + len(key)
            if not last and (in_header or verify):
                assert key not in store
                assert store.stats().corrupt_records == 1
            # The store stays usable: new records and compaction work around the damage.
            store.put(b"fresh", b"data", fingerprint=FP, codec_id=0)
            store.compact(force=True)
            for k, p, _ in recs:
                if k != key:
                    assert store.get(k) == p
            assert key not in store  # a damaged value is deleted by compaction
        with SegmentStore(cfg) as store:
            assert key not in store and store.get(b"fresh") == b"data"


def test_flip_after_open_is_refused_on_read(tmp_path: Path) -> None:
    cfg, recs = build_spread(tmp_path)
    with SegmentStore(cfg) as store:
        key, payload, meta = recs[5]
        flip(tmp_path / segment_name(meta.segment), meta.offset + HEADER_BYTES + len(key) + 9, 4)
        with pytest.raises(CorruptDataError, match="checksum"):
            store.get(key)
        assert store.get(recs[4][0]) == recs[4][1]


def test_compaction_rebuilds_headers_damaged_after_open(tmp_path: Path) -> None:
    cfg, recs = build_spread(tmp_path)
    with SegmentStore(cfg) as store:
        key, payload, meta = recs[2]
        flip(tmp_path / segment_name(meta.segment), meta.offset + 20, 0x10)  # seq field
        assert store.get(key) == payload  # the payload itself is intact and verified
        store.compact(force=True)
    with SegmentStore(cfg) as store:
        assert contents(store) == {k: p for k, p, _ in recs}
        assert store.stats().corrupt_records == 0


def test_resync_after_damage_mid_sealed_segment(tmp_path: Path) -> None:
    cfg, recs = build_spread(tmp_path)
    first = seg_paths(tmp_path)[0]
    on_first = [r for r in recs if r[2].segment == 1]
    assert len(on_first) >= 3
    key, payload, meta = on_first[1]
    # Overwrite the magic of the middle record: the scanner must find the next one.
    with open(first, "r+b") as f:
        f.seek(meta.offset)
        f.write(b"XXXX")
    with SegmentStore(cfg) as store:
        assert key not in store
        assert store.stats().corrupt_records == 1
        for k, p, _ in recs:
            if k != key:
                assert store.get(k) == p
        check_accounting(store, tmp_path)


def test_corrupt_newest_value_does_not_resurrect_older_one_through_compaction(
    tmp_path: Path,
) -> None:
    cfg = make_config(tmp_path, segment_max_bytes=4096)
    with SegmentStore(cfg) as store:
        store.put(b"k", b"old" * 100, fingerprint=FP, codec_id=1)
        for i in range(20):
            store.put(b"pad%d" % i, b"p" * 300, fingerprint=FP, codec_id=1)
        meta = store.put(b"k", b"new" * 100, fingerprint=FP, codec_id=1)
        for i in range(20):
            store.put(b"pad2-%d" % i, b"p" * 300, fingerprint=FP, codec_id=1)
        flip(tmp_path / segment_name(meta.segment), meta.offset + HEADER_BYTES + 5, 1)
        with pytest.raises(CorruptDataError):
            store.get(b"k")
        result = store.compact(force=True)
        assert result.corrupt_dropped == 1
        assert b"k" not in store
    with SegmentStore(cfg) as store:
        assert b"k" not in store
        assert len(store) == 40


# ---------------------------------------------------------------- compaction


def churn(store: SegmentStore, n: int = 60) -> dict[bytes, bytes]:
    model: dict[bytes, bytes] = {}
    for i in range(n):
        key = b"k%d" % i
        model[key] = bytes([i % 251]) * 250
        store.put(key, model[key], fingerprint=FP, codec_id=1)
    for i in range(0, n, 3):
        store.delete(b"k%d" % i)
        del model[b"k%d" % i]
    for i in range(1, n, 3):
        model[b"k%d" % i] = b"v2-%d" % i * 20
        store.put(b"k%d" % i, model[b"k%d" % i], fingerprint=FP, codec_id=2)
    return model


def test_compaction_keeps_live_set_and_reclaims_space(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, segment_max_bytes=4096, compact_garbage_ratio=0.3)
    with SegmentStore(cfg) as store:
        model = churn(store)
        before = store.stats()
        result = store.compact()
        after = store.stats()
        assert result.segments_in > 0 and result.bytes_reclaimed > 0
        assert after.bytes_on_disk == result.bytes_after < before.bytes_on_disk
        assert contents(store) == model
        check_accounting(store, tmp_path)
        full = store.compact(force=True)
        assert result.tombstones_dropped + full.tombstones_dropped > 0
        assert store.stats().tombstones == 0
        assert store.stats().live_bytes == store.stats().bytes_on_disk - store.stats().dead_bytes
        assert contents(store) == model
        # Idle segments are compacted only when they hold garbage.
        assert store.compact().segments_in == 0
    with SegmentStore(cfg) as store:
        assert contents(store) == model
        check_accounting(store, tmp_path)
        assert store.stats().dead_bytes <= 4 * HEADER_BYTES * store.stats().segments


def test_compacting_everything_dead_leaves_nothing(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, segment_max_bytes=4096)
    with SegmentStore(cfg) as store:
        for i in range(30):
            store.put(b"k%d" % i, b"x" * 300, fingerprint=FP, codec_id=1)
        for i in range(30):
            store.delete(b"k%d" % i)
        store.compact(force=True)  # leaves one small file committing the removal
        store.compact(force=True)
        assert store.stats().segments == 0 and seg_paths(tmp_path) == []
        store.put(b"again", b"v", fingerprint=FP, codec_id=1)
    with SegmentStore(cfg) as store:
        assert contents(store) == {b"again": b"v"}


def test_tombstone_outlives_compaction_while_its_value_is_on_disk(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, segment_max_bytes=4096, compact_garbage_ratio=0.5)
    with SegmentStore(cfg) as store:
        # Segment 1: the doomed value among live ones, so it is never worth compacting.
        store.put(b"doomed", b"d" * 100, fingerprint=FP, codec_id=1)
        for i in range(11):
            store.put(b"live%d" % i, b"l" * 300, fingerprint=FP, codec_id=1)
        # Segment 2: the tombstone among values that are overwritten (garbage).
        churned = store.put(b"churn", b"c" * 300, fingerprint=FP, codec_id=1)
        assert churned.segment == 2
        store.delete(b"doomed")
        for _ in range(10):
            store.put(b"churn", b"c" * 300, fingerprint=FP, codec_id=1)
        assert store.put(b"filler", b"f" * 300, fingerprint=FP, codec_id=1).segment == 3
        result = store.compact()
        assert result.segments_in >= 1 and store.meta(b"live0").segment == 1
        assert result.tombstones_dropped == 0
    with SegmentStore(cfg) as store:
        assert b"doomed" not in store
        # Once the value's segment is compacted too, the tombstone can go.
        store.compact(force=True)
        store.compact(force=True)
        assert store.stats().tombstones == 0
    with SegmentStore(cfg) as store:
        assert b"doomed" not in store and len(store) == 13


def test_torn_tail_of_active_segment_below_a_compaction_output(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, segment_max_bytes=4096)
    with SegmentStore(cfg) as store:
        model = churn(store)
        active = store.put(b"pre", b"p", fingerprint=FP, codec_id=1).segment
        assert store.compact().segments_out >= 1
        # Compaction outputs are numbered above the active segment, which keeps growing.
        assert max(int(p.name[4:12]) for p in seg_paths(tmp_path)) > active
        assert store.put(b"x", b"kept", fingerprint=FP, codec_id=1).segment == active
        torn = store.put(b"y", b"torn" * 10, fingerprint=FP, codec_id=1)
        assert torn.segment == active
    path = tmp_path / segment_name(active)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 5)
    with SegmentStore(cfg) as store:
        assert contents(store) == model | {b"pre": b"p", b"x": b"kept"}
        assert store.stats().corrupt_records == 0
        assert path.stat().st_size == torn.offset
        assert store.put(b"z", b"z", fingerprint=FP, codec_id=1).segment == active


def snapshot(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst)


def compaction_scenario(tmp_path: Path) -> tuple[ArchiveConfig, dict[bytes, bytes], Path]:
    """A store whose force compaction drops tombstones; returns config, model, pre-copy."""
    cfg = make_config(tmp_path / "live", segment_max_bytes=4096)
    with SegmentStore(cfg) as store:
        model = churn(store)
    pre = tmp_path / "pre"
    snapshot(tmp_path / "live", pre)
    return cfg, model, pre


def test_crash_after_rename_before_unlink(tmp_path: Path) -> None:
    cfg, model, pre = compaction_scenario(tmp_path)
    inputs = {p.name for p in seg_paths(pre)}
    with SegmentStore(cfg) as store:
        result = store.compact(force=True)
        assert result.tombstones_dropped > 0
    outputs = [p for p in seg_paths(cfg.directory) if p.name not in inputs]
    assert len(outputs) == result.segments_out
    # Every subset of the inputs may still be there (unlinks in any order).
    for mask in range(1 << len(inputs)):
        crashed = tmp_path / f"crash{mask}"
        crashed.mkdir()
        for j, name in enumerate(sorted(inputs)):
            if mask >> j & 1:
                shutil.copy(pre / name, crashed / name)
        for out in outputs:
            shutil.copy(out, crashed / out.name)
        with SegmentStore(make_config(crashed)) as store:
            assert contents(store) == model, mask
            check_accounting(store, crashed)
        assert {p.name for p in seg_paths(crashed)} == {p.name for p in outputs}
        if mask > 4:
            break  # a few subsets are enough to keep the test fast


def test_crash_before_rename_leaves_inputs(tmp_path: Path) -> None:
    cfg, model, pre = compaction_scenario(tmp_path)
    with SegmentStore(cfg) as store:
        store.compact(force=True)
    out = seg_paths(cfg.directory)[-1]
    number = int(out.name[4:12])
    partial = out.read_bytes()[: out.stat().st_size // 2]
    (pre / f"seg-{number:08d}.compacting").write_bytes(partial)
    with SegmentStore(make_config(pre)) as store:
        assert contents(store) == model
        store.put(b"after", b"crash", fingerprint=FP, codec_id=1)
    assert not list(pre.glob("*.compacting"))
    with SegmentStore(make_config(pre)) as store:
        assert contents(store) == model | {b"after": b"crash"}


def test_failed_unlink_mid_compaction_reopens_right(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, model, _ = compaction_scenario(tmp_path)
    real_unlink = Path.unlink
    calls = {"n": 0}

    def crashing_unlink(self: Path, missing_ok: bool = False) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("simulated crash")
        real_unlink(self, missing_ok=missing_ok)

    store = SegmentStore(cfg)
    monkeypatch.setattr(Path, "unlink", crashing_unlink)
    with pytest.raises(OSError, match="simulated"):
        store.compact(force=True)
    monkeypatch.undo()
    store.close()
    with SegmentStore(cfg) as store:
        assert contents(store) == model
        check_accounting(store, cfg.directory)


def test_failed_write_mid_compaction_keeps_store_usable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, model, _ = compaction_scenario(tmp_path)
    with SegmentStore(cfg) as store:

        def failing_fsync(fd: int) -> None:
            raise OSError("disk gone")

        monkeypatch.setattr(os, "fsync", failing_fsync)
        with pytest.raises(OSError, match="disk gone"):
            store.compact(force=True)
        monkeypatch.undo()
        assert not list(cfg.directory.glob("*.compacting"))
        assert contents(store) == model
        store.put(b"more", b"x", fingerprint=FP, codec_id=1)
        store.compact(force=True)
        assert contents(store) == model | {b"more": b"x"}
    with SegmentStore(cfg) as store:
        assert contents(store) == model | {b"more": b"x"}


# ---------------------------------------------------------------- rollover, fsync


def test_rollover_at_segment_max_bytes(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, segment_max_bytes=4096)
    payload = b"r" * 1000
    per_segment = 4096 // record_size(b"k00", payload)
    with SegmentStore(cfg) as store:
        metas = [store.put(b"k%02d" % i, payload, fingerprint=FP, codec_id=1) for i in range(10)]
        big = store.put(b"big", b"B" * 10_000, fingerprint=FP, codec_id=1)
        after = store.put(b"after", b"a", fingerprint=FP, codec_id=1)
    assert [m.segment for m in metas] == [1 + i // per_segment for i in range(10)]
    # A record larger than a segment gets a segment of its own.
    assert big.offset == 0 and after.segment == big.segment + 1 and after.offset == 0
    sizes = [p.stat().st_size for p in seg_paths(tmp_path)]
    assert all(s <= 4096 for s in sizes[:-2]) and sizes[-2] > 4096
    with SegmentStore(cfg) as store:
        assert store.get(b"big") == b"B" * 10_000 and len(store) == 12


@pytest.mark.parametrize(
    ("policy", "batch", "expected_after_puts", "expected_after_flush"),
    [
        # one fsync per record, plus the directory once for the new file
        ("always", 64, 10 + 1, 10 + 1),
        # records 4 and 8 (+ the directory with the first), the remaining 2 on flush
        ("batch", 4, 2 + 1, 2 + 1 + 1),
        ("never", 4, 0, 0),
    ],
)
def test_fsync_policies(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    policy: str,
    batch: int,
    expected_after_puts: int,
    expected_after_flush: int,
) -> None:
    calls: list[int] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        calls.append(fd)
        real_fsync(fd)

    cfg = make_config(tmp_path, fsync=policy, fsync_batch=batch)
    store = SegmentStore(cfg)
    monkeypatch.setattr(os, "fsync", counting_fsync)
    for i in range(10):
        store.put(b"k%d" % i, b"v", fingerprint=FP, codec_id=1)
    assert len(calls) == expected_after_puts
    store.flush()
    assert len(calls) == expected_after_flush
    store.close()  # nothing left to sync
    assert len(calls) == expected_after_flush


def test_batch_policy_syncs_on_close_and_rollover(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(fd))
    cfg = make_config(tmp_path, fsync="batch", fsync_batch=1000, segment_max_bytes=4096)
    store = SegmentStore(cfg)
    store.put(b"a", b"x" * 3000, fingerprint=FP, codec_id=1)
    assert calls == []
    store.put(b"b", b"x" * 3000, fingerprint=FP, codec_id=1)  # seals segment 1
    assert len(calls) == 2  # segment 1 and the directory
    store.close()
    assert len(calls) == 4  # segment 2 and the directory (its new name)


def test_an_active_segment_that_is_mostly_garbage_is_compacted_without_force(
    tmp_path: Path,
) -> None:
    """[2/6] item 11: 6.2 MB dead in the active segment of a big-segment store was never
    compacted (only sealed segments were)."""
    from memkv.storage.segments import ACTIVE_COMPACT_MIN_BYTES

    cfg = make_config(tmp_path, segment_max_bytes=64 << 20, compact_garbage_ratio=0.5)
    with SegmentStore(cfg) as store:
        value = b"x" * (64 << 10)
        for i in range(48):
            store.put(b"k%d" % i, value, fingerprint=FP, codec_id=1)
        for i in range(40):
            store.delete(b"k%d" % i)
        assert store.stats().segments == 1  # all of it in the active segment
        assert store.stats().dead_bytes >= ACTIVE_COMPACT_MIN_BYTES
        result = store.compact()
        assert result.segments_in == 1 and result.bytes_reclaimed > 40 * len(value) * 0.9
        assert contents(store) == {b"k%d" % i: value for i in range(40, 48)}
        store.put(b"after", b"v", fingerprint=FP, codec_id=1)  # writes go on
    with SegmentStore(cfg) as store:
        assert len(contents(store)) == 9

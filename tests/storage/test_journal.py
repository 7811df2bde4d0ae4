"""The router's journal: records survive, a torn tail is cut, snapshots replace history."""

import os

import pytest

from memkv.errors import CorruptDataError
from memkv.storage.journal import Journal


def test_records_replay_in_order_across_reopen(tmp_path):
    j = Journal(tmp_path)
    for i in range(5):
        j.append({"op": "n", "i": i, "key": bytes([i]) * 16})
    j.sync()
    j.close()
    again = Journal(tmp_path)
    assert [r["i"] for r in again.replay()] == list(range(5))
    assert next(iter(Journal(tmp_path).replay()))["key"] == b"\x00" * 16


def test_a_torn_last_record_is_cut_and_new_records_follow_the_last_whole_one(tmp_path):
    j = Journal(tmp_path)
    for i in range(3):
        j.append({"i": i})
    j.close()
    log = tmp_path / "journal.log"
    whole = log.stat().st_size
    with open(log, "ab") as f:
        f.write(b"\x40\x00\x00\x00garbage")  # a crash in the middle of an append
    j = Journal(tmp_path)
    assert [r["i"] for r in j.replay()] == [0, 1, 2]
    assert log.stat().st_size == whole
    j.append({"i": 3})
    j.close()
    assert [r["i"] for r in Journal(tmp_path).replay()] == [0, 1, 2, 3]
    # A flipped byte inside a record ends the replay there too (its CRC fails).
    data = bytearray(log.read_bytes())
    data[12] ^= 0xFF  # the second record's length (the first is 12 bytes)
    log.write_bytes(bytes(data))
    assert [r["i"] for r in Journal(tmp_path).replay()] == [0]


def test_a_snapshot_replaces_the_history_atomically(tmp_path):
    j = Journal(tmp_path)
    for i in range(10):
        j.append({"i": i})
    j.snapshot([{"i": "state"}])
    assert j.records_since_snapshot == 0
    j.append({"i": 10})
    j.close()
    assert [r["i"] for r in Journal(tmp_path).replay()] == ["state", 10]
    (tmp_path / "snapshot.bin").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00abc")
    with pytest.raises(CorruptDataError, match="snapshot"):
        list(Journal(tmp_path).replay())


def test_sync_is_a_group_commit(tmp_path, monkeypatch):
    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(fd) or real(fd))
    j = Journal(tmp_path)
    first = j.append({"i": 1})
    second = j.append({"i": 2})
    j.sync(first)  # forces both: an fsync covers everything written before it
    j.sync(second)
    j.sync()
    assert len(calls) == 1
    Journal(tmp_path / "nofsync", fsync=False).sync()
    assert len(calls) == 1
